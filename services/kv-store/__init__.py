"""kv-store: the global KV cache service (CPU memory tier)."""
