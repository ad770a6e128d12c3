"""Where each process's threads spend their time, from a sampling profiler's stacks.

Reads py-spy's ``raw`` output (``py-spy record --format raw --threads [--subprocesses] [--idle]``:
one line per distinct stack, ``process;[child process;]thread;frame;...;frame COUNT``) and prints, for each of the
busiest threads, the share of samples each function appears in (inclusive) and the share whose
innermost frame of this project's code is a given line ("own" time: the time under a line of
``tandem/``, the libraries it calls included, so a Triton launch or a wait on a collective is
charged to the line that made it). With ``--idle`` the samples count waits too, which is what
tells a host that waits for the GPU from one that cannot keep up with it.

    py-spy record --pid PID --subprocesses --threads --idle --nonblocking --rate 250 --duration 8 \\
        --format raw -o samples.txt
    python -m benchmarks.host_samples samples.txt [--top 25] [--threads 4] [--focus FUNCTION ...]

``--focus`` prints the inclusive share of the named functions for every thread (for example
``EngineCore._complete PlanChannel.send ModelRunner.forward``). Used by ``scripts/gpu_checks.sh
tp-host``. Imports nothing but the standard library.
"""
from __future__ import annotations

import argparse
import collections
import gzip
from dataclasses import dataclass, field
from typing import Iterable, TextIO

PROJECT = "tandem/"


@dataclass
class ThreadSamples:
    name: str  # "process ...;thread ..."
    total: int = 0
    inclusive: collections.Counter = field(default_factory=collections.Counter)  # function -> samples
    own: collections.Counter = field(default_factory=collections.Counter)  # innermost project line -> samples


def function_of(frame: str) -> str:
    """``"Class.method (path:line)"`` -> ``"Class.method"``."""
    return frame.split(" (", 1)[0]


def read_samples(lines: Iterable[str]) -> dict[str, ThreadSamples]:
    """Every thread's samples from py-spy's raw lines (a stack's leading frames name the process,
    a child process after its parent, and the thread)."""
    threads: dict[str, ThreadSamples] = {}
    for line in lines:
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = 0  # the leading frames that name processes (a child's after its parent's) and the thread
        while head < len(frames) and frames[head].startswith(("process ", "thread (")):
            head += 1
        if head == 0:
            continue
        name = ";".join(frames[:head])
        thread = threads.setdefault(name, ThreadSamples(name))
        samples = int(count)
        thread.total += samples
        body = frames[head:]
        for function in {function_of(frame) for frame in body}:
            thread.inclusive[function] += samples
        project = [frame for frame in body if PROJECT in frame]
        if project:
            thread.own[project[-1]] += samples
    return threads


def open_samples(path: str) -> TextIO:
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def busy_samples(thread: ThreadSamples) -> int:
    """Samples under this project's code but its most frequent line: a thread that sits on one
    line (a watcher blocked in a wait) ranks last, the engine's loop first."""
    return sum(thread.own.values()) - max(thread.own.values(), default=0)


def report(threads: dict[str, ThreadSamples], top: int, count: int, focus: list[str]) -> str:
    lines = []
    busiest = sorted(threads.values(), key=busy_samples, reverse=True)[:count]
    for thread in busiest:
        parts = thread.name.split(";")
        process = next((part for part in reversed(parts) if part.startswith("process ")), "")
        name = parts[-1] if parts[-1].startswith("thread (") else ""
        lines.append(f"\n=== {process[:70]} {name}: {thread.total} samples, "
                     f"{sum(thread.own.values()) / max(thread.total, 1):.0%} under this project's code")
        for function in focus:
            lines.append(f"  {thread.inclusive[function] / thread.total:6.1%}  {function} (inclusive)")
        lines.append("  own (innermost line of this project's code):")
        lines += [f"  {samples / thread.total:6.1%}  {frame[:150]}" for frame, samples in thread.own.most_common(top)]
        lines.append("  inclusive:")
        lines += [f"  {samples / thread.total:6.1%}  {function[:150]}"
                  for function, samples in thread.inclusive.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", help="py-spy raw output (.gz read as gzip)")
    parser.add_argument("--top", type=int, default=25, help="functions and lines per thread")
    parser.add_argument("--threads", type=int, default=4, help="how many threads (the busiest in this project's "
                                                               "code first)")
    parser.add_argument("--focus", nargs="*", default=[], metavar="FUNCTION")
    args = parser.parse_args()
    with open_samples(args.samples) as lines:
        print(report(read_samples(lines), args.top, args.threads, args.focus))


if __name__ == "__main__":
    main()
