"""What only workers load: the vLLM worker, the KV connector and the vLLM plugin, the kv-store client,
host-device KV moves, the embedded models, streaming detokenization.

Imports llmesh.wire and llmesh.policies only (tests/unit/test_layers.py)."""
