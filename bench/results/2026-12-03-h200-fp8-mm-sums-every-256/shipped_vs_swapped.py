"""At each swept (shape, rows): the shipped fp8_mm_config's time against the best
transposed (SWAP_AB) and unswapped tiles of a sweep.
    PYTHONPATH=src:. python shipped_vs_swapped.py fp8_mm_sweep_48_64_swapped.json.gz"""
import gzip
import json
import sys

from bench.diagnostics.gemv_sweep import SHAPES
from csrc_triton.fp8_mm import fp8_mm_config

rows = json.load(gzip.open(sys.argv[1]))["rows"]
for name, (N, K) in SHAPES.items():
    for M in sorted({r["M"] for r in rows}):
        cfg = fp8_mm_config(M, N, K, 132)
        timed = [r for r in rows if r["shape"] == name and r["M"] == M
                 and r.get("kernel") == "triton" and "us" in r]
        shipped = [r["us"] for r in timed if cfg and tuple(r["config"]) == tuple(cfg)]
        swapped = min((r for r in timed if r["config"][6:7] == [True]), key=lambda r: r["us"])
        plain = min((r for r in timed if r["config"][6:7] != [True]), key=lambda r: r["us"])
        print(f"{name:8s} M={M:3d} shipped {cfg} {shipped} | best swapped {swapped['us']} "
              f"{swapped['config']} | best unswapped {plain['us']} {plain['config']}")
