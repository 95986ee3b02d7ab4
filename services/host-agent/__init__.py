"""The host agent: pre-started worker processes on one host, activated as workers on placement's command."""
