"""prefill-worker: tokenizes, checks the context, computes the prompt's KV and hands it to the kv-store."""
