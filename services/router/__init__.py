"""router: the OpenAI-compatible front door; dispatches each request to a prefill and a decode worker."""
