"""A GPU-free simulator that drives the production policies (llmesh.policies) on traces."""
