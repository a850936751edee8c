"""The fused MoE kernels' tiles, measured on this GPU for each expert shape, weight type and
row count: csrc_triton/moe_tiles.json, which csrc_triton.moe.moe_tiles reads.

    python -m bench.moe_tuning --models qwen3-30b-a3b mixtral-8x7b --dtypes bf16 fp8 \
        [--tokens 1 2 4 ... 4096] [--budget-s 480] [--table csrc_triton/moe_tiles.json]
    TRITON_INTERPRET=1 python -m bench.moe_tuning --smoke --table /tmp/tiles.json  # CPU

For each model config's experts (E experts, inner width I, hidden H, top-k) and weight type,
and each token count T (T x k rows): random routing (each token k distinct experts, uniformly,
as a model with dummy weights routes), then each candidate tile of each GEMM, timed as a
decode step runs it: inside a CUDA graph (no host launch time between CUDA events: at a few
rows that time was most of what events around one Python launch measured) over ROUTINGS
routings in turn, so that each launch reads other experts' weights than the last one did, from
HBM rather than the L2, as a model's next layer does; the median of 20 replays, per launch.
A candidate whose output differs from the reference loop over experts is dropped. The BLOCK_M
kept is the one whose two GEMMs' best times sum least (BLOCK_M is shared: it sets the rows'
alignment; 1 is the rows path, tried up to 64 rows, with its own candidates); a grouped
BLOCK_M's sum includes its sort (align_by_expert), which the rows path does without, and the
second GEMM's time the sum over each token's k rows after it. The rows path's second GEMM is
also tried adding those rows itself (SUM_ROWS: a program per token, no sum after it). The table
is merged into the file under this GPU's name, so several calls (models, GPUs) fill one file; a
printed line per token count.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import median_gpu_us
from csrc_triton import moe as K
from csrc_triton._interpret import kernels_for
from minivllm.config import ModelConfig
from minivllm.model.moe import _expert_weight, experts_reference, route
from minivllm.model.quantization import quantize_fp8

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
# Routings a candidate's timing cycles through. At one Qwen3-30B-A3B token each reads 8
# experts, 75.5 MB in bf16; 8 of them read more than the L2 holds (50 MB on the H100).
ROUTINGS = 8
CANDIDATES = dict(BLOCK_N=[64, 128], BLOCK_K=[64, 128], num_warps=[4, 8], num_stages=[3, 4])
# The rows path's (BLOCK_M 1, GEMV-shaped): narrow column tiles, long input blocks, the
# weight loads `num_stages` deep (1: not pipelined).
ROWS_CANDIDATES = dict(BLOCK_N=[4, 8, 16, 32], BLOCK_K=[256, 512], num_warps=[2, 4],
                       num_stages=[1, 2, 3])
ROWS_PATH_MAX_ROWS = 64


def block_ms(rows: int) -> list[int]:
    """The BLOCK_M worth trying at this many (token, expert) rows: a decode step's few rows
    fill a small tile at best, or take the rows path (1)."""
    return [1, 16, 32] if rows <= ROWS_PATH_MAX_ROWS else [16, 32, 64, 128]


def experts_of(name: str) -> tuple[int, int, int, int]:
    """(E, I, H, top-k) of bench/model_configs/NAME.json."""
    path = Path(__file__).parent / "model_configs" / f"{name}.json"
    cfg = ModelConfig.from_dict(json.loads(path.read_text()))
    if not cfg.moe:
        raise SystemExit(f"{name} is not a mixture of experts.")
    return (cfg.moe["num_experts"], cfg.moe["intermediate_size"], cfg.hidden_size,
            cfg.moe["top_k"])


def random_experts(e: int, i: int, h: int, dtype: str, device) -> dict:
    """w13 [E, 2I, H], w2 [E, H, I] of the weight type, with their scales (fp8: e4m3 and
    per-output-channel scales, as quantization gives them)."""
    g = torch.Generator(device=device).manual_seed(0)
    w = {"w13": torch.randn(e, 2 * i, h, device=device, generator=g) * h ** -0.5,
         "w2": torch.randn(e, h, i, device=device, generator=g) * i ** -0.5}
    w = {name: t.bfloat16() for name, t in w.items()}
    if dtype == "bf16":
        return {**w, "w13_scale": None, "w2_scale": None}
    out = {}
    for name, t in w.items():  # as MoE.quantize stores them
        q, scale = quantize_fp8(t.reshape(-1, t.shape[-1]))
        out[name], out[name + "_scale"] = q.view(t.shape), scale.view(t.shape[:2])
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within bf16 rounding of sums: the relative (Frobenius) error under 2%."""
    return bool((got.float() - want.float()).norm() <= 0.02 * want.float().norm())


def reference_gate_up(x, w13, scale, ids) -> torch.Tensor:
    """The first GEMM's rows as the reference computes them: row r = x[r // k] @ W13[e].T,
    e = the row's expert (weights dequantized first)."""
    flat = ids.flatten()
    out = torch.empty(flat.numel(), w13.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(flat).tolist():
        rows = torch.where(flat == e)[0]
        w = _expert_weight(w13, scale, None, e, x.shape[1], x.dtype)
        out[rows] = F.linear(x[rows // ids.shape[1]], w)
    return out


def graph_us(launches: list, reps: int) -> float:
    """Microseconds per launch of `launches` replayed back to back in one CUDA graph (the
    median over `reps` replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiled and warm before capture
        for fn in launches:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    return median_gpu_us(graph.replay, reps, warmup=2) / len(launches)


def tune_tokens(w: dict, top_k: int, tokens: int, device, candidates: dict,
                rows_candidates: dict, reps: int, smoke: bool) -> dict:
    """The best tiles at this token count (moe_tiles' entry) and their time, us."""
    mod, _ = kernels_for(K.__name__, device)
    e, n13, h = w["w13"].shape
    dtype = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, h, device=device, generator=g).to(dtype)
    # Each token k distinct experts, uniformly: random router logits. The first routing is
    # checked against the reference; all are timed (graph_us).
    routings = [route(torch.randn(tokens, e, device=device, generator=g), top_k, True, dtype)
                for _ in range(1 if smoke else ROUTINGS)]
    weights, ids = routings[0]
    rows = tokens * top_k
    want13 = reference_gate_up(x, w["w13"], w["w13_scale"], ids)
    want = experts_reference(x, w["w13"], w["w2"], weights, ids, F.silu, w["w13_scale"],
                             w["w2_scale"])
    gate, up = want13.chunk(2, dim=-1)
    want_h = F.silu(gate) * up  # the rows path's first GEMM gates in its epilogue
    flat = [(wt.reshape(-1).contiguous(), i.reshape(-1).contiguous()) for wt, i in routings]
    best = None
    for block_m in block_ms(rows):
        by_rows = block_m == 1
        if not by_rows:
            aligned = [K.align_by_expert(i, e, block_m) for _, i in routings]
        gate_up = torch.empty(rows, n13 // 2 if by_rows else n13, dtype=dtype, device=device)
        out = torch.empty(rows, h, dtype=dtype, device=device)
        summed = torch.empty(tokens, h, dtype=dtype, device=device)
        # The grouped path sorts its rows first, once a layer: that time counts against
        # it (the rows path has no sort).
        picks, total = {}, 0.0
        if not by_rows and not smoke:
            total = graph_us([functools.partial(K.align_by_expert, i, e, block_m)
                              for _, i in routings], reps)
        space = rows_candidates if by_rows else candidates
        hidden = None  # the second GEMM's input, from the first's best tiles

        def launch(gemm: str, tiles: dict, r: int = 0) -> torch.Tensor:
            """The GEMM's launch; the second's result is summed over each token's k rows
            (by the kernel with SUM_ROWS, else after it: that sum is timed too)."""
            first = gemm == "w13"  # reads x by token; the second, its own rows, weighted
            a, dst, k = (x, gate_up, top_k) if first else (hidden, out, 1)
            flat_w, flat_ids = flat[r]
            if tiles.get("SUM_ROWS"):
                K._rows_gemm(mod, a, w[gemm], w[gemm + "_scale"], summed, flat_ids, flat_w,
                             k, first, not first, first, tiles, sum_rows=top_k)
                return summed
            if by_rows:
                K._rows_gemm(mod, a, w[gemm], w[gemm + "_scale"], dst, flat_ids, flat_w, k,
                             first, not first, first, tiles)
            else:
                sorted_rows, block_expert = aligned[r]
                K._gemm(mod, a, w[gemm], w[gemm + "_scale"], None, dst, sorted_rows,
                        block_expert, flat_w, rows, k, first, not first, block_m, tiles)
            return dst if first else out.view(tokens, top_k, -1).sum(dim=1)

        def tries(gemm: str):
            """The candidates, then for the rows path's second GEMM the summing variant of
            the best one at each BLOCK_N (it has top_k times fewer programs)."""
            for values in itertools.product(*space.values()):
                yield dict(zip(space, values))
            if by_rows and gemm == "w2" and fastest is not None:
                yield from ({**fastest[1], "BLOCK_N": n, "SUM_ROWS": True}
                            for n in space["BLOCK_N"])

        for gemm in ("w13", "w2"):
            fastest = None
            for tiles in tries(gemm):
                try:
                    got = launch(gemm, tiles)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip
                    if smoke:  # the interpreter takes any tile: a failure is a bug
                        raise
                    print(f"  skip {gemm} M{block_m} {tiles}: {type(exc).__name__}")
                    continue
                expected = (want_h if by_rows else want13) if gemm == "w13" else want
                if not close(got, expected):
                    print(f"  wrong {gemm} M{block_m} {tiles}: dropped")
                    continue
                us = 0.0 if smoke else graph_us(
                    [functools.partial(launch, gemm, tiles, r) for r in range(len(flat))],
                    reps)
                if fastest is None or us < fastest[0]:
                    fastest = (us, tiles)
            if fastest is None:
                break
            picks[gemm] = fastest[1]
            total += fastest[0]
            if gemm == "w13":
                launch("w13", picks["w13"])
                if by_rows:  # gated in the kernel's epilogue
                    hidden = gate_up
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    hidden = (F.silu(gate) * up).contiguous()
        if len(picks) == 2 and (best is None or total < best["us"]):
            best = {"BLOCK_M": block_m, **picks, "us": round(total, 1)}
    return best


def dumps(table: dict) -> str:
    """The table as JSON, an entry (one row count's tiles) a line."""
    lines = ["{"]
    for i, (gpu, shapes) in enumerate(sorted(table.items())):
        lines.append(f" {json.dumps(gpu)}: {{")
        for j, (key, entries) in enumerate(sorted(shapes.items())):
            lines.append(f"  {json.dumps(key)}: {{")
            rows = sorted(entries, key=int)
            lines += [f"   {json.dumps(r)}: {json.dumps(entries[r], sort_keys=True)}"
                      + ("," if k < len(rows) - 1 else "") for k, r in enumerate(rows)]
            lines.append("  }" + ("," if j < len(shapes) - 1 else ""))
        lines.append(" }" + ("," if i < len(table) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="stop starting new token counts past this, and write what is done")
    p.add_argument("--table", default=str(K.TILES_FILE), help="the JSON file to merge into")
    p.add_argument("--redo", action="store_true",
                   help="measure row counts the table already has for this GPU (a later "
                        "call otherwise goes on where a spent budget stopped one)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny experts on the CPU (interpreted kernels), no timing")
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.smoke:
        device, gpu = torch.device("cpu"), "cpu (smoke)"
        shapes = {"tiny": (4, 24, 32, 2)}
        candidates = dict(BLOCK_N=[16, 32], BLOCK_K=[16], num_warps=[4], num_stages=[1])
        rows_candidates = dict(BLOCK_N=[8], BLOCK_K=[16], num_warps=[2], num_stages=[1])
        args.dtypes, args.tokens = ["bf16"], [1, 9]
    else:
        device, gpu = torch.device("cuda"), torch.cuda.get_device_name()
        shapes = {name: experts_of(name) for name in args.models}
        candidates, rows_candidates = CANDIDATES, ROWS_CANDIDATES
    path = Path(args.table)
    table = json.loads(path.read_text()) if path.exists() else {}
    mine = table.setdefault(gpu, {})
    for (name, (e, i, h, top_k)), dtype in itertools.product(shapes.items(), args.dtypes):
        w = random_experts(e, i, h, dtype, device)
        if args.smoke:
            w = {k: None if v is None else v.float() for k, v in w.items()}
        key = K.tiles_key(w["w13"] if dtype != "bf16" else w["w13"].bfloat16(), top_k)
        for tokens in args.tokens:
            if str(tokens * top_k) in mine.get(key, {}) and not args.redo:
                continue
            if time.perf_counter() - start > args.budget_s:
                print(f"[moe_tuning] budget spent: {name} {dtype} stops before T={tokens}")
                break
            best = tune_tokens(w, top_k, tokens, device, candidates, rows_candidates,
                               args.reps, args.smoke)
            if best is None:
                print(f"[moe_tuning] {name} {dtype} T={tokens}: no candidate ran")
                continue
            mine.setdefault(key, {})[str(tokens * top_k)] = best
            print(f"[moe_tuning] {name} {dtype} T={tokens} rows={tokens * top_k}: {best}",
                  flush=True)
            path.write_text(dumps(table))
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
