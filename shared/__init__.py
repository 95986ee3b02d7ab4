"""llmesh: the common library of the serving mesh, in layers (docs/architecture.md#layers).

- `llmesh.wire`: the contract every service speaks (messages, bus, errors, config, telemetry, KV keys);
- `llmesh.policies`: pure scheduling and placement decisions over snapshots;
- `llmesh.engine`: what only workers load (the vLLM worker, its KV connector and plugin);
- `llmesh.deploy`: the tools that start a mesh (launcher, compose, credentials, healthcheck).

Imports run one way, down: services and the simulator -> engine, deploy -> wire, where engine may also use
policies, which use wire alone (tests/unit/test_layers.py).
"""
