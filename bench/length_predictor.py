"""Length-predictor latency and throughput over NATS, against the model called in-process and
against the same service with batching off, side by side in one run.

    .venv/bin/python bench/length_predictor.py [--requests 300] [--rounds 30] [--seconds 10] [--idle 20]
    .venv/bin/python bench/length_predictor.py --accuracy   # held-out scores in each runtime

Starts nats-server and the service (`python -m llmesh_lengthpred`, the committed model) as
separate processes, and asks with real AlpacaEval prompts from ../shared/data:
- single: one request at a time, back to back; p50/p99 of each round trip (the client's view);
- after idle: single requests 1 s apart, as a lightly used router sends them (the model's
  weights have left the CPU caches by then);
- batch of 32: 32 requests sent at once; p50/p99 of the time until all 32 are answered;
- throughput: 64 requests kept in flight for `--seconds`; predictions per second.
The in-process rows time `Predictor.predict` directly (no NATS, no queue), on one thread as the
service runs it, with the encoder in each runtime (`MESH_LENGTH_RUNTIME`: torch fp32, torch int8,
ONNX Runtime int8, the service's default); their CPU column is the process's CPU time per single
prediction (p50). The last service runs with MESH_LENGTH_MAX_BATCH=1 (each prompt alone through
the model).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import get_args

from llmesh.bus import Bus
from llmesh.launcher import Child, start_nats, start_service
from llmesh.lengths import cut_prompt
from llmesh.messages import LengthPrediction, LengthPredictRequest, Subjects
from llmesh_lengthpred.settings import ARTIFACT_DIR, LengthPredictorSettings

IN_FLIGHT = 64
IDLE_GAP_S = 1.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def row(name: str, single: list[float], batch: list[float], throughput: float, cpu: list[float] | None = None) -> str:
    ms = lambda v: f"{v * 1000:.1f}"  # noqa: E731
    return (f"| {name} | {ms(percentile(single, .5))} | {ms(percentile(single, .99))} | "
            f"{ms(percentile(cpu, .5)) if cpu else '–'} | "
            f"{ms(percentile(batch, .5))} | {ms(percentile(batch, .99))} | {throughput:.0f} |")


def prompts() -> list[str]:
    from llmesh_lengthpred import data

    return sorted({e.prompt for e in data.load("llama", len)})


# MESH_LENGTH_RUNTIME's values, the service's default last
RUNTIMES = get_args(LengthPredictorSettings.model_fields["length_runtime"].annotation)[::-1]


def in_process(texts: list[str], args, runtime: str) -> str:
    from llmesh_lengthpred.predictor import Predictor

    predictor = Predictor(args.artifact, threads=1, runtime=runtime)
    call = lambda batch: predictor.predict(*zip(*[cut_prompt(t) for t in batch]))  # noqa: E731
    call(texts[:32])  # warm-up
    single, cpu = [], []
    for i in range(args.requests):
        started, cpu_started = time.perf_counter(), time.process_time()
        call([texts[i % len(texts)]])
        single.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    batch = []
    for r in range(args.rounds):
        chunk = [texts[(r * 32 + j) % len(texts)] for j in range(32)]
        started = time.perf_counter()
        call(chunk)
        batch.append(time.perf_counter() - started)
    name = f"in-process model call, {runtime}" + (" (service default)" if runtime == RUNTIMES[-1] else "")
    return row(name, single, batch, 32 / statistics.median(batch), cpu)


async def over_nats(nats_url: str, texts: list[str], args) -> tuple[list[float], list[float], float, list[float]]:
    bus = await Bus.connect(nats_url, "bench-length")

    async def ask(text: str) -> None:
        await bus.request(Subjects.LENGTH_PREDICT, LengthPredictRequest(prompt=cut_prompt(text)[0]), LengthPrediction,
                          timeout=30)

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


def service_run(workdir: Path, nats_url: str, max_batch: int, texts: list[str], args) -> tuple:
    env = {"MESH_NATS_URL": nats_url, "MESH_LENGTH_MAX_BATCH": str(max_batch), "MESH_LOG_LEVEL": "WARNING"}
    child: Child = start_service("length-predictor", env, workdir / f"svc-{max_batch}.log")
    try:
        async def ready() -> None:
            bus = await Bus.connect(nats_url, "bench-wait")
            try:
                for _ in range(600):
                    try:
                        await bus.request(Subjects.LENGTH_PREDICT, LengthPredictRequest(prompt="hi"), LengthPrediction,
                                          timeout=1)
                        return
                    except Exception:
                        await asyncio.sleep(0.2)
                raise TimeoutError("the length predictor did not start")
            finally:
                await bus.close()

        asyncio.run(ready())
        return asyncio.run(over_nats(nats_url, texts, args))
    finally:
        child.stop()


def accuracy(artifact: Path) -> None:
    """An artifact on its training run's held-out split (same seed), with the encoder in each
    runtime: what quantizing costs in accuracy."""
    import numpy as np

    from llmesh_lengthpred import data, train
    from llmesh_lengthpred.predictor import Predictor

    results = []
    for runtime in RUNTIMES:
        predictor = Predictor(artifact, threads=1, runtime=runtime)
        meta = predictor.meta
        count = lambda text: len(predictor.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        _, test = data.split_by_prompt(data.load(meta["family"], count), 0.2, meta["seed"])
        prompts = sorted({e.prompt for e in test})
        by_prompt = dict(zip(prompts, predictor.predict(*map(list, zip(*map(cut_prompt, prompts))))))
        predictions = [by_prompt[e.prompt] for e in test]
        results.append(train.score(f"MiniLM + LoRA, {runtime}", None,
                                   np.array([p.bucket for p in predictions]),
                                   np.array([p.expected_tokens for p in predictions]), [e.output_tokens for e in test]))
    print(train.table(meta["family"], len(test), results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="single requests timed")
    parser.add_argument("--rounds", type=int, default=30, help="batches of 32 timed")
    parser.add_argument("--seconds", type=float, default=10, help="throughput run length")
    parser.add_argument("--idle", type=int, default=20, help=f"single requests timed {IDLE_GAP_S:.0f} s apart")
    parser.add_argument("--accuracy", action="store_true", help="held-out accuracy in each runtime instead")
    parser.add_argument("--artifact", type=Path, default=ARTIFACT_DIR, help="the model (default: the committed one; "
                        "the service rows always run the committed one)")
    args = parser.parse_args()
    if args.accuracy:
        return accuracy(args.artifact)
    texts = prompts()
    workdir = Path(tempfile.mkdtemp(prefix="bench-length-"))
    nats, nats_url = start_nats(workdir)
    try:
        batched = service_run(workdir, nats_url, 32, texts, args)
        unbatched = service_run(workdir, nats_url, 1, texts, args)
    finally:
        nats.stop()
    lines = ["| path | single p50 ms | single p99 ms | single CPU p50 ms | batch of 32 p50 ms | batch of 32 p99 ms "
             "| predictions/s |",
             "|---|---|---|---|---|---|---|",
             *(in_process(texts, args, runtime) for runtime in RUNTIMES),
             row("service over NATS (batches up to 32)", *batched[:3]),
             row("service over NATS, batching off", *unbatched[:3])]
    print(f"{len(texts)} distinct AlpacaEval prompts; {args.requests} single requests, {args.rounds} batches of 32, "
          f"{IN_FLIGHT} in flight for {args.seconds:.0f} s\n")
    print("\n".join(lines))
    for name, run in (("batches up to 32", batched), ("batching off", unbatched)):
        idle = [1000 * t for t in run[3]]
        if idle:
            print(f"\nsingle request after {IDLE_GAP_S:.0f} s idle, service ({name}): p50 {percentile(idle, .5):.1f} ms, "
                  f"p99 {percentile(idle, .99):.1f} ms, max {max(idle):.1f} ms", end="")
    print()
    print(f"\nthroughput, batching on / off: {batched[2] / unbatched[2]:.2f}x")


if __name__ == "__main__":
    main()
