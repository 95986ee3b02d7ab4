from pydantic import Field

from llmesh.config import CommonSettings


class KvStoreSettings(CommonSettings):
    capacity_bytes: int = Field(2 * 1024**3, description="Memory the store may hold, in bytes.")
    assembly_timeout_s: float = Field(30.0, description="Drop a split put whose segments stop arriving.")
