"""bench.proc_cpu (the W3 server's CPU per process and thread) and the OS names minivllm
gives its threads, on this machine's /proc."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import proc_cpu
from minivllm.thread_names import set_os_thread_name

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")

BURN = """
import sys, threading, time
from minivllm.thread_names import set_os_thread_name
def burn(name):
    set_os_thread_name(name)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        pass
set_os_thread_name("mv-test-main")
t = threading.Thread(target=burn, args=("mv-test-burner",))
t.start()
print("ready", flush=True)
t.join()  # the main thread idles
"""


def test_a_busy_thread_is_named_and_counted_in_its_process_tree():
    # a parent shell running the Python child: the tree walk must reach the grandchild
    proc = subprocess.Popen(["/bin/sh", "-c", f'"{sys.executable}" -c \'{BURN}\''],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"  # imports done, burner started
        t0 = time.monotonic()
        before = proc_cpu.snapshot(proc.pid)
        time.sleep(0.5)
        after = proc_cpu.snapshot(proc.pid)
        rows = proc_cpu.shares(before, after, time.monotonic() - t0, proc.pid)
    finally:
        proc.wait(10)
    by_name = {r["name"]: r for r in rows}
    assert by_name["root:sh"]["share"] < 0.2
    child = by_name["mv-test-main"]  # the main thread's name is the process's
    assert 0.6 < child["share"] < 1.3
    assert child["threads"][0]["name"] == "mv-test-burner"
    assert all(t["name"] != "mv-test-main" for t in child["threads"])  # idle: left out


def test_names_apply_to_the_calling_thread_only():
    seen = {}

    def named():
        set_os_thread_name("a-very-long-thread-name")
        seen["tid"] = threading.get_native_id()
        seen["comm"] = Path(f"/proc/self/task/{seen['tid']}/comm").read_text().strip()

    main_comm = Path("/proc/self/comm").read_text()
    t = threading.Thread(target=named)
    t.start()
    t.join()
    assert seen["comm"] == "a-very-long-thr"  # the kernel keeps 15 characters
    assert Path("/proc/self/comm").read_text() == main_comm
