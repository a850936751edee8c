"""Summarize py-spy raw (folded) stacks: where each thread of a process spent its samples.

    python -m bench.pyspy_summary FILE [FILE ...] [--top N]

For each file (one process, recorded with --threads): per thread, the share of samples
spent in each function itself (self) and below it (inclusive), busiest first. Samples of
a thread blocked in a wait (select, poll, a lock, a pipe read, a CUDA event's synchronize)
count as samples too: py-spy reports what the thread is doing, idle or not, unless run
with --idle off (the default, which drops idle samples it can recognise).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def load(path: Path) -> dict[str, Counter]:
    """{thread label: Counter of stacks (tuple of frames, outermost first)}"""
    threads: dict[str, Counter] = {}
    for line in path.read_text().splitlines():
        line = line.rstrip()
        if not line or " " not in line:
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        # recorded with --threads, the first frame names the thread: "thread (TID): NAME"
        threads.setdefault(frames[0], Counter())[tuple(frames[1:])] += int(count)
    return threads


def summarize(stacks: Counter, top: int) -> list[str]:
    total = sum(stacks.values())
    own: Counter = Counter()
    below: Counter = Counter()
    for frames, n in stacks.items():
        if frames:
            own[frames[-1]] += n
        for f in set(frames):
            below[f] += n
    lines = [f"  {total} samples"]
    lines += ["  self:"] + [f"    {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines += ["  inclusive:"] + [f"    {100 * n / total:5.1f}%  {f}"
                                 for f, n in below.most_common(top)]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    for path in args.files:
        print(f"== {path}")
        for thread, stacks in sorted(load(path).items(), key=lambda kv: -sum(kv[1].values())):
            print(f" {thread}")
            print("\n".join(summarize(stacks, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
