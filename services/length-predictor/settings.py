from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from llmesh.config import CommonSettings

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifact"


class LengthPredictorSettings(CommonSettings):
    """Named `length_*`: `make run` gives every service the same environment."""
    NATS_USER: ClassVar[str] = "length-predictor"

    length_replica: str = Field(
        "", description="This replica's name (predictions name it, so that reports of actual lengths come back "
        "to it); default: length-<host>-<pid>.")
    length_artifact_dir: Path = Field(
        ARTIFACT_DIR, description="The trained model (LoRA adapter, head, bucket medians); the default is the "
        "one committed with the service (rebuilt by `python -m llmesh_lengthpred.train --family llama --out DIR`).")
    length_max_batch: int = Field(
        32, ge=1, description="Most prompts run through the model at once; requests that arrive while a batch "
        "runs form the next one.")
    length_threads: int = Field(
        1, ge=0, description="CPU threads for inference (0: the runtime's default). One: the mesh's engines need "
        "the other cores more than a prediction needs to finish sooner, and batching is what scales.")
    length_runtime: Literal["onnx-int8", "torch-int8", "torch"] = Field(
        "onnx-int8", description="How the encoder runs: onnx-int8 (ONNX Runtime, int8 linear layers; the least "
        "CPU), torch-int8 or torch (fp32, as trained). The int8 ones hold held-out accuracy (docs/benchmarks.md); a "
        "prompt's answer then moves by a few percent with the prompts batched beside it.")
    length_pending_predictions: int = Field(
        10000, ge=1, description="Prompts kept until the worker reports the request's actual length (the oldest "
        "are forgotten first).")
    length_recent_samples: int = Field(
        5000, ge=1, description="Most (prompt, actual length) pairs kept for a refit (in Redis when `redis_url` "
        "is set, shared by the replicas; else in memory).")
    length_metrics_host: str = Field("127.0.0.1", description="Address the /metrics endpoint binds.")
    length_metrics_port: int = Field(
        0, ge=0, description="Serve Prometheus /metrics on this port; 0: no HTTP endpoint (the same numbers "
        "answer on NATS at mesh.length.stats.<replica>).")
