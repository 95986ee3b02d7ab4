"""Run a module as `__main__` under cProfile on its main thread's CPU clock (`time.thread_time`), the stats
written to OUT when it exits: where a process's own CPU goes, not the time it waits or is preempted (py-spy's
wall-clock samples count a thread preempted inside a system call as busy there). The profile starts at SIGUSR1
(sent once the process serves), so imports and start-up stay out of it.

    python bench/thread_profiled.py OUT MODULE [ARG ...]
    python -c 'import pstats; pstats.Stats("OUT").sort_stats("tottime").print_stats(30)'
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
import time


def main() -> None:
    out, module = sys.argv[1], sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    profiler = cProfile.Profile(time.thread_time)
    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    main()
