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
        "for it (Prism's device memory). 0: half of this machine's memory.",
    )
    host_heartbeat_s: float = Field(1.0, gt=0, description="How often it reports its standbys and workers.")
    log_dir: Path | None = Field(
        None,
        description="Where each standby, and the worker it becomes, writes its log (standby-<role>-<n>.log); "
        "default: a new temporary folder, named in the agent's log.",
    )

    def memory_bytes(self) -> int:
        if self.host_memory_gib:
            return int(self.host_memory_gib * 2**30)
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
