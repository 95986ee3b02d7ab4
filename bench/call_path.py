"""One request's path through the router's code as a newcomer reads it, call by call (issue 55): the files in
the order it goes through them, how often each is entered, and how often the reader comes back to one.

    .venv/bin/python bench/call_path.py [--from Dispatcher.generate] [--requests stream plain chat] [--json PATH]

`make run`'s mesh with modelled engines (bench/harness.py's `launch_mesh`), and a second router in this process on
its NATS and Redis, where a profiler hook sees its calls. Each request goes once untraced (what a first request
starts lazily, started), then once traced. Recorded: calls between project functions (services/router/, shared/;
comprehensions and lambdas are their function's) made by a function of the request (the root: the route's
handler or `--from`'s function, and what it calls), else in a task one of them created; in route mode, the
framework's running of the response the handler returned counts as called by the handler. The path: depth
first along each distinct caller -> callee edge once, in the order of their first calls, back in the caller
after each (`--calls-only`: not); a stay is a run of steps in one file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import inspect
import json
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType

import httpx
from fastapi import FastAPI

from llmesh.deploy.launcher import free_port

ROOT = Path(__file__).resolve().parent.parent
PROJECT = (ROOT / "services" / "router", ROOT / "shared")
SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
ROUTES = {"stream": "/v1/completions", "plain": "/v1/completions", "chat": "/v1/chat/completions"}
MODEL_DIR = Path.home() / ".cache" / "llmesh"  # (bench/control_plane.py's: the embedded model built there once)
Fn = tuple[str, str]  # (file, qualified name)


def reading_walk(root: Fn, edges: list[tuple[Fn, Fn]], returns: bool = True) -> list[Fn]:
    """The functions in the order a reader visits them: depth first along each distinct edge once (in the
    order given), back in the caller after each call (unless not `returns`: the calls alone)."""
    callees: dict[Fn, dict[Fn, None]] = {}
    for caller, callee in edges:
        if caller != callee:
            callees.setdefault(caller, {})[callee] = None
    walk, walked = [root], set()

    def visit(fn: Fn) -> None:
        for callee in callees.get(fn, ()):
            if (fn, callee) not in walked:
                walked.add((fn, callee))
                walk.append(callee)
                visit(callee)
                walk.extend([fn] if returns else [])

    visit(root)
    return walk


def path_counts(walk: list[Fn]) -> dict:
    """Stays (runs of one file, with their functions), distinct files, per file its entries and functions, and
    the returns to a file already left."""
    stays: list[tuple[str, list[str]]] = []
    for file, name in walk:
        if not stays or stays[-1][0] != file:
            stays.append((file, []))
        if name not in stays[-1][1]:
            stays[-1][1].append(name)
    files: dict[str, dict] = {}
    for file, names in stays:
        entry = files.setdefault(file, {"entered": 0, "functions": set()})
        entry["entered"] += 1
        entry["functions"].update(names)
    return {
        "stays": len(stays),
        "files": len(files),
        "returns": len(stays) - len(files),
        "per_file": {f: {"entered": e["entered"], "functions": len(e["functions"])} for f, e in files.items()},
        "path": [{"file": file, "functions": names} for file, names in stays],
    }


class CallRecorder:
    """Caller -> callee edges between project functions of the first request to call the root (a profiler hook and
    a task factory); `adopt_orphans`: a call in the request's tasks with no caller of the request is the root's."""

    def __init__(self, is_root: Callable[[CodeType], bool], adopt_orphans: bool):
        self.is_root, self.adopt_orphans = is_root, adopt_orphans
        self.root: CodeType | None = None
        self.edges: dict[tuple[CodeType, CodeType], None] = {}
        self._tasks: dict[asyncio.Task, CodeType | None] = {}  # the request's tasks -> the function that made each
        self._frames: dict[int, FrameType] = {}  # the request's frames still running
        self._outside: dict[int, FrameType] = {}  # the root's callers
        self._ours: dict[CodeType, bool] = {}

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_task_factory(self._task_factory)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        self._loop.set_task_factory(None)
        self._frames.clear()
        self._outside.clear()

    def project(self, code: CodeType) -> bool:
        if (ours := self._ours.get(code)) is None:
            path = Path(code.co_filename).resolve()
            ours = self._ours[code] = not code.co_name.startswith("<") and any(path.is_relative_to(p) for p in PROJECT)
        return ours

    def _nearest(self, frame: FrameType | None) -> CodeType | None:
        while frame is not None and id(frame) not in self._frames:
            frame = frame.f_back
        return frame.f_code if frame is not None else None

    def _task_factory(self, loop, coro, context=None):
        task = asyncio.Task(coro, loop=loop, context=context)
        creator = self._nearest(sys._getframe(1))
        if creator is not None or asyncio.current_task(loop) in self._tasks:
            self._tasks[task] = creator
        return task

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "return":
            if not frame.f_code.co_flags & SUSPENDABLE:
                self._frames.pop(id(frame), None)
            return
        code = frame.f_code
        if event != "call" or not self.project(code) or id(frame) in self._frames or id(frame) in self._outside:
            return
        task = asyncio.current_task(self._loop)
        if self.root is None:
            if task is None or not self.is_root(code):
                return
            self.root, self._tasks[task] = code, None
            back = frame.f_back
            while back is not None:
                self._outside[id(back)] = back
                back = back.f_back
        else:  # called by a function of the request (in whatever task resumes it), else in a task of the request
            caller = self._nearest(frame.f_back)
            if caller is None and task in self._tasks:
                caller = self._tasks[task] or (self.root if self.adopt_orphans else None)
            if caller is None:
                return
            self.edges[(caller, code)] = None
        self._frames[id(frame)] = frame


def fn(code: CodeType) -> Fn:
    """A function as the path names it: its file under services/router/ or shared/ (`llmesh`), its qualname."""
    path = Path(code.co_filename).resolve()
    return next(str(path.relative_to(p)) for p in PROJECT if path.is_relative_to(p)), code.co_qualname


async def send(http, url: str, kind: str, model: str) -> None:
    body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": kind == "stream"}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "Say hello to the mesh."}]
    else:
        body["prompt"] = "The mesh routes this request to a worker"
    async with http.stream("POST", f"{url}{ROUTES[kind]}", json=body) as resp:
        await resp.aread()
        if resp.status_code != 200:
            raise RuntimeError(f"{kind}: HTTP {resp.status_code} {resp.text[:300]}")


async def trace_router(nats_url: str, redis_url: str, work: Path, headers: dict, args) -> dict[str, dict]:
    """Run the router here, send each request once untraced and once traced: each one's counts."""
    from llmesh_router.__main__ import main as router_main  # noqa: PLC0415
    from llmesh_router.settings import RouterSettings  # noqa: PLC0415

    port = free_port()
    settings = RouterSettings(
        port=port, nats_url=nats_url, redis_url=redis_url, secrets_dir=work / "secrets", model_dir=MODEL_DIR
    )
    url, stop = f"http://127.0.0.1:{port}", asyncio.Event()
    router = asyncio.create_task(router_main(settings, stop))
    results = {}
    try:
        async with httpx.AsyncClient(headers=headers, timeout=120) as http:
            for _ in range(600):  # until it has heard the workers' heartbeats
                if router.done():
                    router.result()
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                await asyncio.sleep(0.5)
            else:
                raise TimeoutError("the router in this process found no workers")
            gc.unfreeze()  # (the router froze its startup heap, the app among it, out of get_objects' sight)
            app = next(o for o in gc.get_objects() if isinstance(o, FastAPI))
            handlers = {route.path: route.endpoint.__code__ for route in app.routes if hasattr(route, "endpoint")}
            model = settings.catalogue()[0].name
            by_route = args.from_ == "route"
            for kind in args.requests:
                await send(http, url, kind, model)  # (untraced: what a first request starts lazily, started)
                handler = handlers[ROUTES[kind]]
                recorder = CallRecorder(
                    (lambda code: code is handler) if by_route else (lambda code: code.co_qualname == args.from_),
                    adopt_orphans=by_route,
                )
                recorder.start()
                try:
                    await send(http, url, kind, model)
                    await asyncio.sleep(1.0)  # what the request's tasks do after its answer (releases, aborts)
                finally:
                    recorder.stop()
                if recorder.root is None:
                    raise RuntimeError(f"{kind}: nothing called {args.from_}")
                edges = [(fn(a), fn(b)) for a, b in recorder.edges]
                root = fn(recorder.root)
                walk = reading_walk(root, edges, returns=not args.calls_only)
                results[kind] = {"root": root} | path_counts(walk) | {"edges": edges}
    finally:
        stop.set()
        await router
    return results


def report(kind: str, result: dict) -> str:
    lines = [
        f"{kind} from {result['root'][1]} ({result['root'][0]}): {result['stays']} stays in {result['files']} files, "
        f"{result['returns']} returns to a file already left",
        textwrap.fill(" > ".join(s["file"] for s in result["path"]), 116, initial_indent="  ", subsequent_indent="  "),
        f"  {'file':<28} {'entered':>7} {'functions':>9}",
    ]
    for file, entry in sorted(result["per_file"].items(), key=lambda kv: -kv[1]["entered"]):
        lines.append(f"  {file:<28} {entry['entered']:>7} {entry['functions']:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="from_", default="route", help="root: 'route' (the handler) or a qualname")
    parser.add_argument("--requests", nargs="+", default=["stream"], choices=list(ROUTES))
    parser.add_argument("--calls-only", action="store_true", help="the walk without the returns to the callers")
    parser.add_argument("--json", type=Path, help="also write each request's counts and path here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    from control_plane import PROFILE  # noqa: PLC0415
    from harness import launch_mesh  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="call-path-") as tmp:
        work = Path(tmp)
        with launch_mesh(work, MODEL_DIR, 600, MESH_MODELLED_ENGINE=PROFILE, MESH_LOG_LEVEL="WARNING") as mesh:
            joining = mesh.service_env()  # (the router here is one more service of the mesh)
            nats, redis = joining["MESH_NATS_URL"], joining["MESH_REDIS_URL"]
            results = asyncio.run(trace_router(nats, redis, work, mesh.headers, args))
    for kind, result in results.items():
        print(report(kind, result), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "requests": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
