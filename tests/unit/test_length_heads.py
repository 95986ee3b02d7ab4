"""The length predictor's heads per served model: which head answers, the automatic refit every
`length_refit_every` samples of a model, and its gate (a refit that does not lower the held-out log
loss is rejected); what a refit fits (median-unbiased on its samples, its slope shrunk toward the
constant where the score does not order them) and what reads which centre (the remaining-length
model the mean). The heads, batching and refit are the service's own; only the artifact's score is
a stand-in (the log of a prompt's word count), and the bus a recorder."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from llmesh.wire.lengths import bucket_of
from llmesh.wire.messages import LengthHead, LengthObserved, LengthPredictRequest, LengthRefit
from llmesh_lengthpred import data
from llmesh_lengthpred.predictor import REFIT_SEED, Head, Predictor
from llmesh_lengthpred.regression import bucket_probs
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


def skewed(seed: int, n: int = 2000, slope: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Scores and lengths whose log-lengths are skewed low around `slope`·score + 5 (as a verbose
    model's are: a few very short answers pull the mean of log-length under its median)."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(0.0, 0.5, n)
    noise = -rng.exponential(0.6, n) + rng.normal(0.0, 0.1, n)
    return scores, np.maximum(np.round(np.expm1(slope * scores + 5.0 + noise)), 1.0)


def above(head: Head, scores: np.ndarray, lengths: np.ndarray) -> float:
    """The share of `lengths` above `head`'s point estimate."""
    return float(np.mean(lengths > np.expm1(head.mu(scores))))


def test_a_refit_on_skewed_log_lengths_is_median_unbiased_and_beats_the_least_squares_centre():
    fit_scores, fit_lengths = skewed(0)
    held_scores, held_lengths = skewed(1, 500)
    head, _, after = Predictor.refit_head(
        Head(sigma=0.5), fit_scores, fit_lengths.tolist(), held_scores, held_lengths.tolist()
    )
    assert head is not None and head.informative
    # half of the samples it was fitted on lie above its estimate, half below (the median of the
    # residuals is 0), and so do held-out ones, within sampling error
    assert above(head, fit_scores, fit_lengths) == pytest.approx(0.5, abs=0.002)
    assert above(head, held_scores, held_lengths) == pytest.approx(0.5, abs=0.05)
    # the least-squares centre (the mean of log-length) predicts too short on such samples
    mean_centred = Head(head.a, head.b, head.sigma)
    assert above(mean_centred, fit_scores, fit_lengths) > 0.6
    assert head.shift > 0.15 and head.b == pytest.approx(np.mean(np.log1p(fit_lengths) - head.a * fit_scores))
    least_squares_mae = np.abs(np.expm1(mean_centred.mu(held_scores)) - held_lengths).mean()
    assert after["mae_tokens"] < 0.95 * least_squares_mae
    # the score orders these samples: the slope is kept (near the least-squares one), and beats the constant
    assert head.a > 0.7 and after["mae_tokens"] < 0.8 * after["constant_mae_tokens"]


def test_a_score_that_does_not_order_the_samples_gives_the_constant():
    _, lengths = skewed(2)
    noise = np.random.default_rng(3).normal(0.0, 0.5, len(lengths))  # a score unrelated to the lengths
    head = Head.fit(noise, lengths.tolist())
    assert head.a == 0.0 and np.expm1(head.mu(noise[:3])) == pytest.approx([np.median(lengths)] * 3)


def test_a_slope_that_costs_mae_on_the_fitted_samples_is_shrunk_toward_the_constant():
    # the score tells the 10% of one-line answers apart and nothing about the rest: the least-squares
    # slope, set by the short ones, spreads the others' estimates and loses to their median in tokens
    rng = np.random.default_rng(5)
    short = rng.random(1000) < 0.1
    scores = np.where(short, rng.normal(-2.0, 0.3, 1000), rng.normal(0.0, 1.0, 1000))
    lengths = np.where(short, rng.integers(2, 8, 1000), np.round(np.exp(rng.normal(6.0, 0.5, 1000))))
    y = np.log1p(lengths)
    slope = np.polyfit(scores, y, 1)[0]
    least_squares = np.expm1(slope * scores + np.median(y - slope * scores))
    constant_mae = np.abs(np.median(lengths) - lengths).mean()
    assert np.abs(least_squares - lengths).mean() > 1.2 * constant_mae
    head = Head.fit(scores, lengths.tolist())
    assert 0.0 <= head.a < 0.5 * slope
    assert np.abs(np.expm1(head.mu(scores)) - lengths).mean() <= constant_mae
    assert above(head, scores, lengths) == pytest.approx(0.5, abs=0.002)


def test_the_point_estimate_and_buckets_read_the_median_and_the_remaining_length_model_the_mean():
    predictor = WordCountScores()
    head = Head(a=1.0, b=2.0, sigma=0.4, shift=0.3)
    predictor.model_heads["m"] = head
    prompt = PROMPTS[11]
    score = np.log1p([len(prompt.split())])
    (prediction,) = predictor.predict([prompt], [len(prompt)], ["m"])
    median = float(np.expm1(1.0 * score[0] + 2.3))
    assert prediction.expected_tokens == pytest.approx(median)
    assert prediction.bucket == int(bucket_probs(head.mu(score), head.sigma).argmax()) == bucket_of(round(median))
    assert prediction.confidence == pytest.approx(bucket_probs(head.mu(score), head.sigma).max())

    class Remaining:
        def predict(self, prompts, generated, tokens, mu):
            self.mu = mu
            return np.zeros(len(prompts))

    predictor.remaining = Remaining()  # type: ignore[assignment]
    predictor.tokenizer = lambda texts, **_: {"input_ids": [t.split() for t in texts]}  # type: ignore[assignment]
    predictor.predict_remaining([prompt], ["so far"], [6], [2], ["m"])
    assert predictor.remaining.mu == pytest.approx(1.0 * score + 2.0)  # the mean, as it was trained on


def test_a_head_without_a_shift_keeps_its_bytes_and_version():
    old = b'{"a": 0.9, "b": 1.5, "informative": true, "sigma": 0.7}'  # a head saved before `shift`
    head = Head.from_bytes(old)
    assert head == Head(0.9, 1.5, 0.7, True, 0.0) and head.to_bytes() == old
    assert head.version == Head(0.9, 1.5, 0.7).version
    shifted = Head(0.9, 1.5, 0.7, True, 0.25)
    assert Head.from_bytes(shifted.to_bytes()) == shifted and shifted.version != head.version
    with pytest.raises(ValueError):
        Head.from_bytes(b'{"a": 0.9, "b": 1.5, "informative": true, "sigma": 0.7, "shift": NaN}')
