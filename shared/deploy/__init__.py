"""The tools that start and check a mesh: the launcher (`make run`), compose files, the mesh's credentials,
the containers' healthcheck.

Imports llmesh.wire only (tests/unit/test_layers.py)."""
