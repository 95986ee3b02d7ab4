"""The contract every service speaks: messages, the bus, errors, settings, telemetry, KV keys and the
kv-store's data-plane framing, length buckets, secrets as services read them, the service runtime.

Imports nothing from the other llmesh layers (tests/unit/test_layers.py)."""
