"""The router's length tags: a request's predicted output length from the length predictor.

Awaited before dispatch only when a policy reads it (`before_dispatch`); otherwise a sample of
requests is predicted beside the prefill (`beside`, for the trace, the decode worker's report and
the predictor's online scoring), never on the time to first token. A request never waits long for
a prediction: an absent, slow or failing predictor means no tag, counted by outcome and noted on
the request's span.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Protocol

from opentelemetry import context, trace

from llmesh.wire import telemetry
from llmesh.wire.bus import Bus
from llmesh.wire.errors import MeshError, ServiceUnavailable, Timeout
from llmesh.wire.lengths import cut_prompt
from llmesh.wire.messages import LengthPrediction, LengthPredictRequest, Subjects

from .metrics import RouterMetrics

log = logging.getLogger(__name__)


class Tagged(Protocol):
    """What a request shows the length predictor."""

    @property
    def request_id(self) -> str: ...

    @property
    def deadline(self) -> float: ...  # wall-clock

    @property
    def model(self) -> str: ...  # the served model: the predictor answers with its head

    @property
    def length_prompt(self) -> str | None: ...


class LengthTagger:
    def __init__(
        self,
        bus: Bus,
        metrics: RouterMetrics,
        timeout_s: float,
        *,
        before_dispatch: bool = False,
        sample_fraction: float = 1.0,
        seed: int = 0,
    ):
        self.bus, self.metrics, self.timeout_s = bus, metrics, timeout_s
        self.needed_before_dispatch = before_dispatch  # a dispatch or queue policy reads predicted lengths
        self.sample_fraction = sample_fraction  # else: requests predicted beside the prefill
        self._sampler = random.Random(seed)
        self._tracer = telemetry.tracer("llmesh.router")

    async def before_dispatch(self, request: Tagged, parent: context.Context) -> LengthPrediction | None:
        """The tag a policy reads, awaited (None when no policy reads one, or none came)."""
        if not self.needed_before_dispatch:
            return None
        return self._note(parent, *await self._ask(request, parent))

    def beside(self, request: Tagged, parent: context.Context) -> asyncio.Task | None:
        """A sampled prediction that runs while the prefill does (None if not sampled, or already
        predicted before dispatch)."""
        if self.needed_before_dispatch:
            return None
        if self._sampler.random() >= self.sample_fraction:
            self.metrics.length_predictions.labels("unsampled").inc()
            return None
        return asyncio.create_task(self._ask(request, parent))

    def so_far(self, task: asyncio.Task | None, parent: context.Context) -> LengthPrediction | None:
        """`beside`'s prediction if it is in; a late one is dropped (nothing waits for it). Counted
        here, once: a reply that lands as the task is cancelled is still late."""
        if task is None:
            return None
        if not task.done():
            task.cancel()
            return self._note(parent, "late", None)
        return self._note(parent, *task.result())

    async def _ask(self, request: Tagged, parent: context.Context) -> tuple[str, LengthPrediction | None]:
        text = request.length_prompt
        if not text or not text.strip():
            return "skipped", None
        prompt, chars = cut_prompt(text)
        try:
            with self._tracer.start_as_current_span("router.length", context=parent):
                prediction, _ = await self.bus.request(
                    Subjects.LENGTH_PREDICT,
                    LengthPredictRequest(
                        request_id=request.request_id, prompt=prompt, prompt_chars=chars, model=request.model
                    ),
                    LengthPrediction,
                    timeout=min(self.timeout_s, request.deadline - time.time()),
                )
            return "ok", prediction
        except Timeout:
            return "timeout", None
        except ServiceUnavailable:
            return "unavailable", None
        except MeshError as exc:
            log.warning("length prediction for %s failed: %s: %s", request.request_id, exc.code, exc.message)
            return "error", None

    def _note(
        self, parent: context.Context, outcome: str, prediction: LengthPrediction | None
    ) -> LengthPrediction | None:
        self.metrics.length_predictions.labels(outcome).inc()
        span = trace.get_current_span(parent)
        if prediction is None:
            span.set_attribute("length.prediction", outcome)
        else:
            span.set_attributes(
                {
                    "length.prediction": outcome,
                    "length.bucket": prediction.label,
                    "length.expected_tokens": prediction.expected_tokens,
                    "length.confidence": prediction.confidence,
                    "length.model_version": prediction.model_version,
                }
            )
        return prediction
