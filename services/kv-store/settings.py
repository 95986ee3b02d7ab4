from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from llmesh.wire.config import CommonSettings


class KvStoreSettings(CommonSettings):
    NATS_USER: ClassVar[str] = "kv-store"
    kv_shard: str = Field(
        "0",
        description="This shard's name: keys are spread over the live shards by "
        "rendezvous hashing of the names; its stats answer on mesh.kv.<shard>.stats.",
    )
    capacity_bytes: int = Field(2 * 1024**3, description="Memory the store may hold, in bytes.")
    data_dir: Path = Field(
        Path.home() / ".cache" / "llmesh" / "kv-store",
        description="SSD tier directory (a subdirectory per shard); chunks survive restarts.",
    )
    ssd_capacity_bytes: int = Field(8 * 1024**3, ge=0, description="SSD tier size in bytes; 0 disables the tier.")
    ssd_clean_watermark: float = Field(
        0.75,
        ge=0,
        le=1,
        description="Past this fraction of memory, least recently "
        "used chunks are copied to SSD in the background, so evicting them later "
        "costs no write on the put path.",
    )
    ssd_admission: Literal["read", "all"] = Field(
        "read",
        description="Which chunks the cleaner copies to SSD: 'read', those read at least once (a chunk never "
        "read is dropped when memory evicts it: the disk's bandwidth goes to reused KV); 'all', every chunk "
        "(nothing leaves the store before the SSD tier is full, while the disk keeps up with the puts).",
    )
    shared_arena: bool = Field(
        True,
        description="Keep the memory tier in a /dev/shm file that clients on this "
        "host map, so large puts are written straight into it (no copy by the shard).",
    )
    data_host: str = Field("127.0.0.1", description="Address the direct data plane (TCP) binds.")
    data_port: int = Field(0, ge=0, description="Data plane port; 0: any free port (announced over NATS).")
    data_advertise_host: str = Field(
        "",
        description="Host name clients use to reach the data plane; empty: `data_host` (set it when binding 0.0.0.0).",
    )
    max_value_bytes: int = Field(1024**3, gt=0, description="Largest transfer one data-plane frame may carry.")
    lmcache_port: int = Field(
        0,
        ge=0,
        description="Also serve LMCache's lm:// protocol on this port (binding "
        "`data_host`), for vLLM+LMCache's `remote_url`; 0: off.",
    )
    lmcache_allow: str = Field(
        "127.0.0.1/32,::1/128",
        description="Networks whose clients the lm:// port serves, "
        "comma-separated (LMCache's protocol carries no credential); others are cut off "
        "and logged.",
    )
    heartbeat_s: float = Field(1.0, gt=0, description="How often the shard announces itself on NATS.")
    metrics_host: str = Field("127.0.0.1", description="Address the /metrics endpoint binds.")
    metrics_port: int = Field(
        0,
        ge=0,
        description="Serve Prometheus /metrics on this port; 0: no HTTP endpoint "
        "(the same counters answer on NATS at mesh.kv.<shard>.stats).",
    )

    @model_validator(mode="after")
    def _valid_networks(self) -> "KvStoreSettings":
        self.lmcache_networks()  # a typo fails at start
        return self

    def lmcache_networks(self) -> list[IPv4Network | IPv6Network]:
        return [ip_network(n.strip()) for n in self.lmcache_allow.split(",") if n.strip()]
