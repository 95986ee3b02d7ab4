from pathlib import Path
from typing import ClassVar

from pydantic import Field

from llmesh.wire.config import CommonSettings
from llmesh.wire.messages import LengthRefit

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifact"


class LengthPredictorSettings(CommonSettings):
    """Named `length_*`: `make run` gives every service the same environment."""

    NATS_USER: ClassVar[str] = "length-predictor"

    length_replica: str = Field(
        "",
        description="This replica's name (predictions name it, so that reports of actual lengths come back "
        "to it); default: length-<host>-<pid>.",
    )
    length_artifact_dir: Path = Field(
        ARTIFACT_DIR,
        description="The trained models (prompt-only and remaining-length regressions); the default "
        "is the one committed with the service (rebuilt by `python -m llmesh_lengthpred.train --out DIR`).",
    )
    length_max_batch: int = Field(
        32,
        ge=1,
        description="Most prompts run through the model at once; requests that arrive while a batch "
        "runs form the next one.",
    )
    length_generator: str = Field(
        "",
        description="The served model's name (e.g. Meta-Llama-3-8B-Instruct): the models take the generator "
        "and its family (llama, gpt-4, mistral, qwen…) as an input; empty: unknown, the average over all of them.",
    )
    length_pending_predictions: int = Field(
        10000,
        ge=1,
        description="Prompts kept until the worker reports the request's actual length (the oldest "
        "are forgotten first).",
    )
    length_recent_samples: int = Field(
        5000,
        ge=1,
        description="Most (prompt, actual length) pairs kept for a refit, per served model (in Redis when "
        "`redis_url` is set, shared by the replicas; else in memory).",
    )
    length_refit_every: int = Field(
        200,
        ge=0,
        description="Refit a served model's own head in the background every this many of its (prompt, actual "
        "length) samples (counted across replicas); kept only if it lowers the held-out log loss; 0: only "
        "`python -m llmesh_lengthpred.refit`.",
    )
    length_refit_min_samples: int = Field(
        LengthRefit().min_samples, ge=2, description="Fewest samples of a model an automatic refit fits on."
    )
    length_refit_holdout: float = Field(
        LengthRefit().holdout_fraction,
        gt=0.0,
        lt=1.0,
        description="Share of an automatic refit's prompts held out to score it against the current head.",
    )
    length_metrics_host: str = Field("127.0.0.1", description="Address the /metrics endpoint binds.")
    length_metrics_port: int = Field(
        0,
        ge=0,
        description="Serve Prometheus /metrics on this port; 0: no HTTP endpoint (the same numbers "
        "answer on NATS at mesh.length.stats.<replica>).",
    )
