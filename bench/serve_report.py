"""Markdown tables from serve_bench JSON results.

    python -m bench.serve_report bench/results/serve_*.json [--out report.md]

One table per file: a row per (server, concurrency), with each server's throughput as a
ratio of the first server's at the same concurrency.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = [
    ("server", "server"), ("c", "concurrency"), ("reqs", "num_requests"),
    ("fail", "failures"), ("out tok/s", "output_tok_per_s"), ("vs first", None),
    ("req/s", "requests_per_s"), ("TTFT p50 ms", "ttft_ms_p50"),
    ("TTFT p99 ms", "ttft_ms_p99"), ("ITL p50 ms", "itl_ms_p50"), ("ITL p99 ms", "itl_ms_p99"),
    ("TPOT ms", "tpot_ms_mean"), ("tok/chunk", "tokens_per_event"),
    ("GPU mem GiB", "peak_gpu_mem_gib"),
]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def render_markdown(payloads: list[dict]) -> str:
    parts = []
    for p in payloads:
        w, env = p.get("workload", {}), p.get("environment", {})
        parts.append(
            f"### W3 serving: {w.get('prompt_tokens')} prompt + {w.get('output_tokens')} "
            f"output tokens, streaming, greedy\n\n"
            f"{env.get('date', '')}, git {env.get('git_commit', '?')}, "
            f"{env.get('gpu') or env.get('cpu') or env.get('machine', '')} "
            f"({env.get('cpu_count')} CPUs, OMP_NUM_THREADS={env.get('omp_num_threads')}), "
            f"torch {env.get('torch')}, transformers {env.get('transformers')}, "
            f"triton {env.get('triton')}, vllm {env.get('vllm')}\n")
        targets = p.get("targets", [])
        cols = [c for c in COLUMNS if c[0] != "GPU mem GiB" or any(
            lv.get("peak_gpu_mem_gib") is not None for t in targets for lv in t["levels"])]
        lines = ["| " + " | ".join(c[0] for c in cols) + " |",
                 "|" + "|".join("---" for _ in cols) + "|"]
        first = {lv["concurrency"]: lv.get("output_tok_per_s")
                 for lv in (targets[0]["levels"] if targets else [])}
        for t in targets:
            for lv in t["levels"]:
                row = []
                for title, key in cols:
                    if title == "server":
                        row.append(t["label"])
                    elif title == "vs first":
                        base, mine = first.get(lv["concurrency"]), lv.get("output_tok_per_s")
                        row.append(f"{mine / base:.2f}x" if base and mine else "-")
                    else:
                        row.append(_fmt(lv.get(key)))
                lines.append("| " + " | ".join(row) + " |")
        parts.append("\n".join(lines) + "\n")
        for t in targets:
            if t.get("launch_cmd"):
                parts.append(f"- `{t['label']}`: `{t['launch_cmd']}`")
            errs = sorted({e for lv in t["levels"] for e in lv.get("errors", [])})
            if errs:
                parts.append(f"- `{t['label']}` errors: " + "; ".join(errs[:3]))
        parts.append("")
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Markdown tables from serve_bench JSON files.")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    md = render_markdown([json.loads(Path(f).read_text()) for f in args.files])
    if args.out:
        Path(args.out).write_text(md)
    else:
        sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
