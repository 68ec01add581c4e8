"""Run a Python module under a CPU-time sampler, for `scripts.bench --scenarios profile`.

    python -m scripts.cpu_sampler OUT [--interval-ms 1] -m MODULE [ARGS...]

Sampling starts at SIGUSR1 and stops at SIGUSR2 (so a start-up's imports are not in it),
or runs from start to exit with --all. Meanwhile, every `--interval-ms` of CPU time the
process spends (user and system: the kernel's ITIMER_PROF), a SIGPROF handler records
the Python stack then running; when sampling stops the stacks go to OUT, one
"frame;frame;... count" line each (frames as "function (file:line)", outermost first),
py-spy's raw format. Unlike a wall-clock
sampler (py-spy), time the process spends waiting for a core on a busy machine is not
counted, so shares of the samples are shares of the CPU. Time in C code (a system call,
uvloop, httptools, msgspec) goes to the Python frame that called it.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import os
import runpy
import signal
import sys
from pathlib import Path
from types import FrameType


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.cpu_sampler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where the stacks go at exit")
    parser.add_argument("--interval-ms", type=float, default=1.0,
                        help="CPU milliseconds between two samples (default 1)")
    parser.add_argument("--all", action="store_true",
                        help="sample from start to exit, not from SIGUSR1 to SIGUSR2")
    parser.add_argument("-m", dest="module", required=True, help="the module to run")
    args, rest = parser.parse_known_args()
    counts: collections.Counter[str] = collections.Counter()

    def sample(signum: int, frame: FrameType | None) -> None:
        stack = []
        while frame is not None:
            code = frame.f_code
            stack.append(f"{code.co_qualname} ({code.co_filename}:{frame.f_lineno})")
            frame = frame.f_back
        counts[";".join(reversed(stack))] += 1

    interval = args.interval_ms / 1000

    def start(*_: object) -> None:
        signal.setitimer(signal.ITIMER_PROF, interval, interval)

    def stop(*_: object) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0)
        partial = args.out.with_name(args.out.name + ".partial")
        partial.write_text("".join(f"{stack} {n}\n" for stack, n in counts.items()))
        os.replace(partial, args.out)  # OUT appears whole

    signal.signal(signal.SIGPROF, sample)
    if args.all:
        atexit.register(stop)
        start()
    else:
        signal.signal(signal.SIGUSR1, start)
        signal.signal(signal.SIGUSR2, stop)
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
