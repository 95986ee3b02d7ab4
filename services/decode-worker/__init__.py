"""decode-worker: loads the prompt's KV from the kv-store layer by layer and streams tokens."""
