"""Length-predictor latency, CPU and throughput: the models called in-process, and the service over
NATS with batching on and off, side by side in one run.

    .venv/bin/python bench/length_predictor.py [--requests 300] [--rounds 30] [--seconds 10] [--idle 20]

Starts nats-server and the service (`python -m llmesh_lengthpred`, the committed models) as
separate processes, and asks with real AlpacaEval prompts from ../shared/data, and for the
remaining length with the prompt and the first 64-512 tokens of a real answer to it:
- single: one request at a time, back to back; p50/p99 of each round trip (the client's view);
- after idle: single requests 1 s apart, as a lightly used router sends them;
- batch of 32: 32 requests sent at once; p50/p99 of the time until all 32 are answered;
- throughput: 64 requests kept in flight for `--seconds`; predictions per second.
The in-process rows time `Predictor.predict` and `Predictor.predict_remaining` directly (no NATS,
no queue) on one thread, as the service runs them; their CPU column is the process's CPU time per
single prediction (p50). The last service runs with MESH_LENGTH_MAX_BATCH=1.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from llmesh.deploy.launcher import Child, start_nats, start_service
from llmesh.wire.bus import Bus
from llmesh.wire.lengths import cut_prompt
from llmesh.wire.messages import (
    LengthPrediction,
    LengthPredictRequest,
    LengthRemaining,
    LengthRemainingRequest,
    Subjects,
)
from llmesh_lengthpred.settings import ARTIFACT_DIR

IN_FLIGHT = 64
IDLE_GAP_S = 1.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def row(name: str, single: list[float], batch: list[float], throughput: float, cpu: list[float] | None = None) -> str:
    ms = lambda v: f"{v * 1000:.1f}"  # noqa: E731
    return (
        f"| {name} | {ms(percentile(single, 0.5))} | {ms(percentile(single, 0.99))} | "
        f"{ms(percentile(cpu, 0.5)) if cpu else '–'} | "
        f"{ms(percentile(batch, 0.5))} | {ms(percentile(batch, 0.99))} | {throughput:.0f} |"
    )


@dataclass(frozen=True)
class Ask:
    """One question to the predictor: a prompt, and for the remaining length the answer so far."""

    prompt: str
    generated: str | None = None
    tokens: int = 0

    def request(self) -> LengthPredictRequest | LengthRemainingRequest:
        prompt = cut_prompt(self.prompt)[0]
        if self.generated is None:
            return LengthPredictRequest(prompt=prompt)
        return LengthRemainingRequest(prompt=prompt, generated=self.generated, generated_tokens=self.tokens)


def questions() -> dict[str, list[Ask]]:
    from llmesh_lengthpred import data
    from llmesh_lengthpred.model import load_tokenizer
    from llmesh_lengthpred.train import prefixes, token_counter

    tokenizer = load_tokenizer()
    examples = data.load(token_counter(tokenizer), ("alpaca-eval",), keep_text=True)
    one_each = list({e.prompt: e for e in examples if e.generator == "gpt4_1106_preview"}.values())
    cut = prefixes(tokenizer, one_each, (64, 256, 512))
    return {
        "prompt": [Ask(e.prompt) for e in sorted(one_each, key=lambda e: e.prompt)],
        "remaining": [Ask(p.example.prompt, p.text, p.seen) for p in cut],
    }


def call(predictor, asks: list[Ask]) -> list:
    if asks[0].generated is None:
        return predictor.predict(*map(list, zip(*(cut_prompt(a.prompt) for a in asks))))
    return predictor.predict_remaining(
        [cut_prompt(a.prompt)[0] for a in asks],
        [a.generated for a in asks],
        [len(a.generated) for a in asks],
        [a.tokens for a in asks],
    )


def in_process(kind: str, asks: list[Ask], args) -> str:
    from llmesh_lengthpred.predictor import Predictor

    predictor = Predictor(args.artifact)
    call(predictor, asks[:32])  # warm-up
    single, cpu = [], []
    for i in range(args.requests):
        started, cpu_started = time.perf_counter(), time.process_time()
        call(predictor, [asks[i % len(asks)]])
        single.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    batch = []
    for r in range(args.rounds):
        started = time.perf_counter()
        call(predictor, [asks[(r * 32 + j) % len(asks)] for j in range(32)])
        batch.append(time.perf_counter() - started)
    return row(f"in-process, {kind}", single, batch, 32 / statistics.median(batch), cpu)


async def over_nats(nats_url: str, texts: list[Ask], args) -> tuple[list[float], list[float], float, list[float]]:
    bus = await Bus.connect(nats_url, "bench-length")

    async def ask(question: Ask) -> None:
        if question.generated is None:
            await bus.request(Subjects.LENGTH_PREDICT, question.request(), LengthPrediction, timeout=30)
        else:
            await bus.request(Subjects.LENGTH_REMAINING, question.request(), LengthRemaining, timeout=30)

    try:
        for text in texts[:32]:  # warm-up
            await ask(text)
        single = []
        for i in range(args.requests):
            started = time.perf_counter()
            await ask(texts[i % len(texts)])
            single.append(time.perf_counter() - started)
        after_idle = []
        for i in range(args.idle):
            await asyncio.sleep(IDLE_GAP_S)
            started = time.perf_counter()
            await ask(texts[i % len(texts)])
            after_idle.append(time.perf_counter() - started)
        batch = []
        for r in range(args.rounds):
            started = time.perf_counter()
            await asyncio.gather(*(ask(texts[(r * 32 + j) % len(texts)]) for j in range(32)))
            batch.append(time.perf_counter() - started)
        answered = 0
        stop_at = time.perf_counter() + args.seconds

        async def client(k: int) -> None:
            nonlocal answered
            while time.perf_counter() < stop_at:
                await ask(texts[(k * 7 + answered) % len(texts)])
                answered += 1

        started = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(IN_FLIGHT)))
        return single, batch, answered / (time.perf_counter() - started), after_idle
    finally:
        await bus.close()


def service_run(workdir: Path, nats_url: str, max_batch: int, asks: dict[str, list[Ask]], args) -> dict[str, tuple]:
    env = {"MESH_NATS_URL": nats_url, "MESH_LENGTH_MAX_BATCH": str(max_batch), "MESH_LOG_LEVEL": "WARNING"}
    child: Child = start_service("length-predictor", env, workdir / f"svc-{max_batch}.log")
    try:

        async def ready() -> None:
            bus = await Bus.connect(nats_url, "bench-wait")
            try:
                for _ in range(600):
                    try:
                        await bus.request(
                            Subjects.LENGTH_PREDICT, LengthPredictRequest(prompt="hi"), LengthPrediction, timeout=1
                        )
                        return
                    except Exception:
                        await asyncio.sleep(0.2)
                raise TimeoutError("the length predictor did not start")
            finally:
                await bus.close()

        asyncio.run(ready())
        return {kind: asyncio.run(over_nats(nats_url, texts, args)) for kind, texts in asks.items()}
    finally:
        child.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="single requests timed")
    parser.add_argument("--rounds", type=int, default=30, help="batches of 32 timed")
    parser.add_argument("--seconds", type=float, default=10, help="throughput run length")
    parser.add_argument("--idle", type=int, default=20, help=f"single requests timed {IDLE_GAP_S:.0f} s apart")
    parser.add_argument(
        "--artifact",
        type=Path,
        default=ARTIFACT_DIR,
        help="the models (default: the committed ones; the service rows always run the committed ones)",
    )
    args = parser.parse_args()
    asks = questions()
    workdir = Path(tempfile.mkdtemp(prefix="bench-length-"))
    nats, nats_url = start_nats(workdir)
    try:
        batched = service_run(workdir, nats_url, 32, asks, args)
        unbatched = service_run(workdir, nats_url, 1, asks, args)
    finally:
        nats.stop()
    lines = [
        "| path | single p50 ms | single p99 ms | single CPU p50 ms | batch of 32 p50 ms | batch of 32 p99 ms "
        "| predictions/s |",
        "|---|---|---|---|---|---|---|",
        *(in_process(kind, asks[kind], args) for kind in asks),
        *(row(f"service over NATS, {kind} (batches up to 32)", *batched[kind][:3]) for kind in asks),
        *(row(f"service over NATS, {kind}, batching off", *unbatched[kind][:3]) for kind in asks),
    ]
    print(
        f"{len(asks['prompt'])} AlpacaEval prompts, {len(asks['remaining'])} answers cut at 64/256/512 tokens; "
        f"{args.requests} single requests, {args.rounds} batches of 32, {IN_FLIGHT} in flight for "
        f"{args.seconds:.0f} s\n"
    )
    print("\n".join(lines))
    for name, run in (("batches up to 32", batched), ("batching off", unbatched)):
        for kind in asks:
            idle = [1000 * t for t in run[kind][3]]
            if idle:
                print(
                    f"\nsingle {kind} request after {IDLE_GAP_S:.0f} s idle, service ({name}): "
                    f"p50 {percentile(idle, 0.5):.1f} ms, p99 {percentile(idle, 0.99):.1f} ms, max {max(idle):.1f} ms",
                    end="",
                )
    print()
    for kind in asks:
        print(f"throughput, {kind}, batching on / off: {batched[kind][2] / unbatched[kind][2]:.2f}x")


if __name__ == "__main__":
    main()
