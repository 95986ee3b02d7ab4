"""llmesh: the common library of the serving mesh (messages, bus, config, telemetry, policies)."""
