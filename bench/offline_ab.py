"""An A/B of minivllm variants on the offline workloads in one device call: each variant in
fresh processes (`bench.vs_vllm offline`), the processes of the variants interleaved
(A B A B ...) so that a slow stretch of the machine, or a process that runs at the slower
of two speeds, does not land on one variant alone; then one JSON with every process's
numbers and a table.

    python -m bench.offline_ab --model qwen2.5-0.5b-instruct --workloads w5,w6 \\
        --variant "graphs1024;;--max-graph-tokens 1024" --variant default \\
        --processes 2 --out DIR [--budget-s 500]

A variant is "LABEL;ENV=VALUE ENV=VALUE;FLAGS": its environment variables and its extra
`bench.vs_vllm offline` flags (both may be empty: "default" alone is the engine as it is).
Each process writes DIR/LABEL/pN/offline_minivllm*.json and DIR/LABEL_pN.log; DIR/ab.json
holds, per variant and workload, each process's best repetition. A process that would
not fit in what is left of --budget-s is not started. --smoke runs it on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench.common import environment


def parse_variant(text: str) -> dict:
    parts = (text.split(";") + ["", ""])[:3]
    label = parts[0].strip()
    if not label or "/" in label:
        raise SystemExit(f"variant {text!r}: a label without '/' comes first")
    env = dict(kv.split("=", 1) for kv in parts[1].split())
    return {"label": label, "env": env, "flags": shlex.split(parts[2])}


def _cell(value: float) -> str:
    """Throughputs as whole numbers, a decode sweep's milliseconds a step to the microsecond."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3f}"


def run_process(args, variant: dict, index: int, timeout: float) -> dict:
    out = Path(args.out) / variant["label"] / f"p{index}"
    cmd = [sys.executable, "-m", "bench.vs_vllm", "offline", "--engine", "minivllm",
           "--model", args.model, "--workloads", args.workloads, "--out", str(out),
           "--work", args.work] + (["--smoke"] if args.smoke else []) + variant["flags"]
    log = Path(args.out) / f"{variant['label']}_p{index}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, **variant["env"]}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    best = {}
    for path in sorted(out.glob("offline_minivllm*.json")):
        best.update({w: b["value"] for w, b in json.loads(path.read_text())["best"].items()})
    return {"process": index, "rc": rc, "seconds": round(time.perf_counter() - start, 1),
            "best": best}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b-instruct")
    p.add_argument("--workloads", default="w1,w2,w5,w6")
    p.add_argument("--variant", action="append", required=True,
                   help='"LABEL;ENV=VALUE ...;FLAGS" (repeat for each variant)')
    p.add_argument("--processes", type=int, default=2, help="fresh processes per variant")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/minivllm-vs-vllm")
    p.add_argument("--budget-s", type=float, default=500)
    p.add_argument("--process-limit-s", type=float, default=240,
                   help="the most one process may take (and what a start must have left)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    if len({v["label"] for v in variants}) != len(variants):
        raise SystemExit("variant labels must differ")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "offline_ab", "model": args.model, "workloads": args.workloads,
              "environment": environment(), "variants": variants, "runs": {}}
    deadline = time.monotonic() + args.budget_s
    for index in range(args.processes):
        for v in variants:
            left = deadline - time.monotonic()
            if left < min(60, args.process_limit_s):
                print(f"[offline_ab] {v['label']} p{index}: not started ({left:.0f} s left)")
                continue
            run = run_process(args, v, index, min(left, args.process_limit_s))
            record["runs"].setdefault(v["label"], []).append(run)
            print(f"[offline_ab] {v['label']} p{index}: {run['best']} "
                  f"(rc {run['rc']}, {run['seconds']} s)", flush=True)
            (Path(args.out) / "ab.json").write_text(json.dumps(record, indent=1))
    print(table(record))
    return 0


def table(record: dict) -> str:
    """Per workload, each variant's best repetition in each of its processes."""
    names = sorted({w for runs in record["runs"].values() for r in runs for w in r["best"]})
    lines = ["| variant | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, runs in record["runs"].items():
        cells = [" / ".join(_cell(r["best"][w]) for r in runs if w in r["best"]) or "-"
                 for w in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
