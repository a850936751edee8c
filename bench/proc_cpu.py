"""CPU time of a process tree, per process and per thread, from /proc (Linux).

bench.w3_gpu takes a snapshot before and after each level of a server it launched and
records each process's and busy thread's share of one core over the level: a share near
1.0 marks the part of the server (HTTP frontend, its receiver thread, the engine process)
that limits it. Names are the kernel's (`comm`), which minivllm sets for its processes and
threads (minivllm.thread_names).
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: Path) -> tuple[str, int, float] | None:
    """(comm, parent pid, user + system CPU seconds) from a /proc stat file."""
    try:
        text = path.read_text()
    except OSError:
        return None
    # comm is in parentheses and may itself hold spaces or parentheses
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    # after comm: state(0) ppid(1) ... utime(11) stime(12)
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def snapshot(root_pid: int) -> dict[int, dict]:
    """{pid: {"name", "cpu_s", "threads": {tid: (name, cpu_s)}}} for root_pid and all its
    descendants alive now."""
    procs: dict[int, tuple[str, int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(entry / "stat")
            if st is not None:
                procs[int(entry.name)] = st
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, dict] = {}
    todo = [root_pid] if root_pid in procs else []
    while todo:
        pid = todo.pop()
        name, _, cpu = procs[pid]
        threads = {}
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                st = _stat(task / "stat")
                if st is not None:
                    threads[int(task.name)] = (st[0], st[2])
        except OSError:
            pass
        out[pid] = {"name": name, "cpu_s": cpu, "threads": threads}
        todo += children.get(pid, [])
    return out


def shares(before: dict[int, dict], after: dict[int, dict], seconds: float,
           root_pid: int, min_thread_share: float = 0.05) -> list[dict]:
    """Per process alive at both ends: its share of one core over `seconds`, and its
    threads using at least min_thread_share; busiest first. The root is named "root:"."""
    rows = []
    if seconds <= 0:
        return rows
    for pid, a in after.items():
        b = before.get(pid)
        if b is None:
            continue
        threads = []
        for tid, (tname, cpu) in a["threads"].items():
            if tid in b["threads"]:
                share = (cpu - b["threads"][tid][1]) / seconds
                if share >= min_thread_share:
                    threads.append({"name": tname, "share": round(share, 2)})
        threads.sort(key=lambda r: -r["share"])
        name = ("root:" if pid == root_pid else "") + a["name"]
        rows.append({"name": name, "pid": pid,
                     "share": round((a["cpu_s"] - b["cpu_s"]) / seconds, 2),
                     "threads": threads})
    rows.sort(key=lambda r: -r["share"])
    return rows
