"""OS-visible names for minivllm's processes and threads (top -H, ps -L, /proc/*/comm).

Python's process and thread names live only inside Python; the kernel shows every one of
them as `python3`. Naming them lets a profile of a busy host (and bench.w3_gpu's per-level
CPU accounting) tell the engine process, the extra HTTP processes and the frontend's
receiver thread apart. Linux only; elsewhere a no-op.
"""

from __future__ import annotations

import threading


def set_os_thread_name(name: str) -> None:
    """Name the calling thread (the process, when called on its main thread) as the
    kernel sees it; at most 15 characters are kept."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
