from pathlib import Path

from pydantic import Field

from llmesh.config import CommonSettings


class KvStoreSettings(CommonSettings):
    capacity_bytes: int = Field(2 * 1024**3, description="Memory the store may hold, in bytes.")
    assembly_timeout_s: float = Field(30.0, description="Drop a split put whose segments stop arriving.")
    data_dir: Path = Field(Path.home() / ".cache" / "llmesh" / "kv-store",
                           description="SSD tier directory (a subdirectory per shard); chunks survive restarts.")
    metrics_host: str = Field("127.0.0.1", description="Address the /metrics endpoint binds.")
    metrics_port: int = Field(0, ge=0, description="Serve Prometheus /metrics on this port; 0: no HTTP endpoint "
                              "(the same counters answer on NATS at mesh.kv.<shard>.stats).")
    ssd_capacity_bytes: int = Field(8 * 1024**3, ge=0, description="SSD tier size in bytes; 0 disables the tier.")
