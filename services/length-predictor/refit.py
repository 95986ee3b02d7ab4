"""Refit the deployed length predictor on what it observed:

    .venv/bin/python -m llmesh_lengthpred.refit [--model NAME] [--min-samples 50] [--holdout 0.2]

One replica fits a new head (the calibration of the model's score to lengths) on the recent
(prompt, actual length) pairs the workers reported (requests that ended by themselves, not at
max_tokens), split by prompt: with `--model`, that served model's own head on its pairs (the
service also does this by itself every MESH_LENGTH_REFIT_EVERY pairs of a model); without, the
shared head, which models without their own use, on every model's pairs. It keeps the current
head unless the new one has the lower log loss on the held-out prompts, and marks it
uninformative if its MAE there does not beat the constant's (predictions then carry
`informative: false` and the policies act as without them). Prints the outcome as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from pydantic import ValidationError

from llmesh.wire.bus import Bus
from llmesh.wire.errors import MeshError
from llmesh.wire.messages import LengthRefit, LengthRefitResult, Subjects
from llmesh.wire.secrets import operator_nats_url

TIMEOUT_S = 600.0


async def refit(nats_url: str, request: LengthRefit, timeout: float = TIMEOUT_S) -> LengthRefitResult:
    bus = await Bus.connect(nats_url, "length-refit")
    try:
        result, _ = await bus.request(Subjects.LENGTH_REFIT, request, LengthRefitResult, timeout=timeout)
        return result
    finally:
        await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nats-url", default=os.environ.get("MESH_NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--min-samples", type=int, default=LengthRefit().min_samples)
    parser.add_argument("--holdout", type=float, default=LengthRefit().holdout_fraction)
    parser.add_argument("--model", default="", help="the served model whose head to refit; default: the shared head")
    args = parser.parse_args()
    try:
        request = LengthRefit(min_samples=args.min_samples, holdout_fraction=args.holdout, model=args.model)
    except ValidationError as exc:
        parser.error("; ".join(f"{e['loc'][0]}: {e['msg']}" for e in exc.errors()))
    try:
        result = asyncio.run(refit(operator_nats_url(args.nats_url), request))
    except (MeshError, OSError) as exc:
        sys.exit(f"refit failed: {exc}")
    print(json.dumps(result.model_dump(), indent=2))


if __name__ == "__main__":
    main()
