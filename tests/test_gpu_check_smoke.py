"""bench/gpu_check.py end to end on the CPU (--smoke: tiny stand-in models, tiny sizes), so
a bug in the script is found here and not in a device call that cannot be repeated."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SECTIONS = "parity,graphs,bf16,w2,sweep,w1,profile,hf"


def test_every_section_runs_in_smoke_mode(tmp_path):
    env = {**os.environ, "GPU_CHECK_W2_VARIANTS": "graphs,not-pipelined,eager",
           "GPU_CHECK_W1_VARIANTS": "default,no-prelude", "GPU_CHECK_HF_PEERS": "eager", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'src'}"}
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", "--sections",
                        SECTIONS, "--out-dir", str(tmp_path / "out"), "--tmp-dir",
                        str(tmp_path / "tmp")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in SECTIONS.split(","):
        data = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert data["section"] == name and data["environment"]["git_commit"]
    w2 = json.loads((tmp_path / "out" / "w2.json").read_text())
    assert [row["env"].get("MINIVLLM_PIPELINE", "1") for row in w2["rows"]] == ["1", "0", "1"]
    assert [row["engine"] for row in w2["rows"]] == [
        "minivllm (CUDA graphs, no compile)", "minivllm (CUDA graphs, no compile, not pipelined)",
        "minivllm eager"]
    assert all(row["tok_per_s"] > 0 for row in w2["rows"])
    w1 = json.loads((tmp_path / "out" / "w1.json").read_text())
    assert [(row["engine"], row["env"]) for row in w1["rows"]] == (
        [("minivllm", {})] * 3 + [("minivllm (no-prelude)",
                                   {"MINIVLLM_DECODE_PRELUDE": "0"})] * 3)


def test_replay_state_probe_imports_and_refuses_a_cpu():
    """The GPU-only diagnostic imports, parses its arguments and exits with a clear message
    on a machine without CUDA, instead of failing in a device call."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'src'}",
           "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "bench.diagnostics.replay_state", "--actions",
                        "base"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "no CUDA device" in r.stdout
