from pathlib import Path
from typing import ClassVar

from pydantic import Field

from llmesh.wire.config import CommonSettings, HostSettings, ModelSettings


class HostAgentSettings(ModelSettings, HostSettings, CommonSettings):
    """The workers it starts read the same environment (their own settings: llmesh.wire.config.WorkerSettings)."""

    NATS_USER: ClassVar[str] = "host-agent"

    host_standbys: int = Field(
        1,
        ge=0,
        description="Pre-started worker processes (llmesh.engine.standby) kept ready for each role, on that role's "
        "cores; one activated is replaced at once. 0: every activation is a cold start.",
    )
    host_memory_gib: float = Field(
        0.0,
        ge=0,
        description="Memory the models placed on this host may hold, weights and KV together: placement's budget "
        "for it (Prism's device memory). 0: an engine per role of each catalogue model at `MESH_KV_CACHE_GIB` "
        "each, and 1 GiB for weights. Placement splits what the running engines leave among the models it places here.",
    )
    host_engines: int = Field(
        0,
        ge=0,
        description="Where every model is aggregated: the most engines that share this host's cores, each given the "
        "cores over them as threads (llmesh.deploy.launcher.engine_cores). 0: one a catalogue model. `make run` sets "
        "it to the decode workers it starts or autoscaling's maximum, for each model.",
    )
    host_heartbeat_s: float = Field(1.0, gt=0, description="How often it reports its standbys and workers.")
    host_refill_wait_s: float = Field(
        60.0,
        ge=0,
        description="After an activation, how long the agent waits for the new worker's first heartbeat before "
        "starting standbys in its place: a standby's imports (~20 s of CPU) would otherwise slow the worker's start "
        "on the same cores. 0: at once.",
    )
    log_dir: Path | None = Field(
        None,
        description="Where each standby, and the worker it becomes, writes its log (standby-<role>-<n>.log); "
        "default: a new temporary folder, named in the agent's log.",
    )

    def memory_bytes(self) -> int:
        gib = self.host_memory_gib or sum(len(m.roles) for m in self.catalogue()) * self.kv_cache_gib + 1
        return int(gib * 2**30)
