"""The length predictor's heads per served model: which head answers, the automatic refit every
`length_refit_every` samples of a model, and its gate (a refit that does not lower the held-out log
loss is rejected). The heads, batching and refit are the service's own; only the artifact's score is
a stand-in (the log of a prompt's word count), and the bus a recorder."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from llmesh.wire.messages import LengthHead, LengthObserved, LengthPredictRequest, LengthRefit
from llmesh_lengthpred import data
from llmesh_lengthpred.predictor import REFIT_SEED, Head, Predictor
from llmesh_lengthpred.service import LengthPredictorService, SharedState
from llmesh_lengthpred.settings import LengthPredictorSettings

pytestmark = pytest.mark.timeout(60)
NO_BLOB = memoryview(b"")
PROMPTS = [f"question {i}: " + "word " * (2 + i % 37) for i in range(60)]


class WordCountScores(Predictor):
    """The real heads and predictions over a stand-in score: log1p(words in the prompt)."""

    def __init__(self) -> None:
        self.replica, self.generator, self.base_version = "unit", data.UNKNOWN, "base"
        self.head, self.model_heads = Head(sigma=0.5), {}

    def scores(self, prompts: list[str]) -> np.ndarray:
        return np.log1p([len(p.split()) for p in prompts])


class RecordingBus:
    def __init__(self) -> None:
        self.published: list[tuple[str, object, bytes]] = []

    async def publish(self, subject: str, msg: object, blob: bytes = b"") -> None:
        self.published.append((subject, msg, blob))


@pytest.fixture
async def service():
    settings = LengthPredictorSettings(
        _env_file=None, redis_url="", length_refit_every=50, length_refit_min_samples=20, length_refit_holdout=0.25
    )
    svc = LengthPredictorService(
        RecordingBus(), WordCountScores(), settings, SharedState("", 1000), ThreadPoolExecutor(1)
    )
    try:
        yield svc
    finally:
        await svc.close()


def shared_median(prompt: str) -> float:
    """What the shared head predicts for `prompt`."""
    return float(np.expm1(Head(sigma=0.5).mu(np.log1p(len(prompt.split())))))


async def observe(svc: LengthPredictorService, model: str, lengths: dict[str, int], report_model: bool = True) -> None:
    for i, (prompt, tokens) in enumerate(lengths.items()):
        request_id = f"{model}-{len(svc.calibration.buckets())}-{i}-{tokens}-{prompt}"
        predicted = await svc.predict(LengthPredictRequest(request_id=request_id, prompt=prompt, model=model), NO_BLOB)
        report = LengthObserved(
            request_id=request_id,
            predicted=predicted,
            actual_tokens=tokens,
            finish_reason="stop",
            model=model if report_model else "",
        )
        await svc.observe(report, NO_BLOB)


async def refit_done(svc: LengthPredictorService, model: str) -> None:
    task = svc._auto_refits.get(model)
    assert task is not None, f"no automatic refit of {model!r} started"
    await asyncio.wait_for(task, 30)


async def test_each_model_is_answered_by_its_own_head_else_by_the_shared_one(service):
    verbose = Head(a=1.0, b=1.0, sigma=0.3)
    service.predictor.model_heads["verbose"] = verbose
    prompt = PROMPTS[7]
    # one batch, three models: each row by its model's head
    own, unknown, unnamed = await asyncio.gather(
        *(service.predict(LengthPredictRequest(prompt=prompt, model=m), NO_BLOB) for m in ("verbose", "new", ""))
    )
    assert own.expected_tokens == pytest.approx(np.expm1(1.0 + np.log1p(len(prompt.split()))))
    assert own.model_version == f"base-{verbose.version}"
    assert unknown == unnamed and unknown.expected_tokens == pytest.approx(shared_median(prompt))
    assert unknown.model_version == service.predictor.version == f"base-{service.predictor.head.version}"
    # a model's own head starts as the shared one: its first refit is gated against it
    assert service.predictor.head_for("new") is service.predictor.head


async def test_a_models_head_is_refitted_every_n_of_its_samples_and_serves_only_it(service):
    # model "verbose" answers three times as long as the shared head says
    lengths = {p: round(3 * shared_median(p)) for p in PROMPTS[:49]}
    await observe(service, "verbose", lengths)
    assert not service._auto_refits and not service.predictor.model_heads, "refitted before 50 samples"
    # the 50th, reported without a model: the prediction's model counts
    await observe(service, "verbose", {PROMPTS[49]: round(3 * shared_median(PROMPTS[49]))}, report_model=False)
    await refit_done(service, "verbose")
    head = service.predictor.model_heads["verbose"]
    for prompt in PROMPTS[20:30]:
        after = await service.predict(LengthPredictRequest(prompt=prompt, model="verbose"), NO_BLOB)
        assert after.expected_tokens == pytest.approx(3 * shared_median(prompt), rel=0.2)
        assert after.model_version == f"base-{head.version}"
    other = await service.predict(LengthPredictRequest(prompt=PROMPTS[3], model="terse"), NO_BLOB)
    assert other.expected_tokens == pytest.approx(shared_median(PROMPTS[3]))
    (subject, announced, blob), *_ = service.bus.published
    assert isinstance(announced, LengthHead) and announced.model == "verbose" and Head.from_bytes(blob) == head
    # the next 49 trigger nothing; another model's samples count apart
    await observe(service, "terse", {p: round(shared_median(p)) for p in PROMPTS[:49]})
    assert not service._auto_refits and set(service.predictor.model_heads) == {"verbose"}


async def test_a_refit_that_does_not_lower_the_held_out_error_is_rejected(service):
    # the fitting part says every answer is 3 tokens, the held-out part agrees with the shared head:
    # a head fitted on the first is worse on the second
    _, held = data.split_by_prompt([data.Example(p, 1, "") for p in PROMPTS[:50]], 0.25, REFIT_SEED)
    held_prompts = {e.prompt for e in held}
    assert 5 <= len(held_prompts) <= 20
    await observe(service, "m", {p: round(shared_median(p)) if p in held_prompts else 3 for p in PROMPTS[:50]})
    await refit_done(service, "m")
    assert "m" not in service.predictor.model_heads and not service.bus.published
    assert service.refits.labels("rejected", "m")._value.get() == 1
    # the operator's refit takes the same path, and says why
    result = await service.refit(LengthRefit(model="m", min_samples=20, holdout_fraction=0.25), NO_BLOB)
    assert not result.accepted and result.after["log_loss"] > result.before["log_loss"] and result.model == "m"
    assert "not better" in result.reason and result.model_version == service.predictor.version


async def test_too_few_samples_skip_the_refit_and_the_shared_head_pools_every_model(service):
    await observe(service, "a", {p: 3 for p in PROMPTS[:10]})
    await observe(service, "b", {p: 3 for p in PROMPTS[10:20]})
    few = await service.refit(LengthRefit(model="a", min_samples=20), NO_BLOB)
    assert not few.accepted and few.samples == 10 and "at least 20" in few.reason
    pooled = await service.refit(LengthRefit(min_samples=20, holdout_fraction=0.25), NO_BLOB)
    assert pooled.samples == 20 and pooled.model == "" and pooled.accepted, pooled
    assert service.predictor.head_for("a") is service.predictor.head != Head(sigma=0.5)
