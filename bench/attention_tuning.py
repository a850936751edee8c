#!/usr/bin/env python3
"""Tile-config sweep of the paged prefill attention kernel on a CUDA GPU.

For each model's head layout and each prefill shape of the GPU workloads (W5: two 4096-token
prompts per step; W6: one 8192-token prompt, alone, beside 16 decode rows at ~8k context,
and after 32 of them as the engine orders a step; W1: a ragged batch of 100..1024; a
2048-token chunk on a 6144-token cached prefix) it runs every config of the sweep through
csrc_triton._launch_prefill, checks it against the current default's output, and times it
(triton.testing.do_bench, median). Fresh prompts are also timed with torch's SDPA backends
(flash, cuDNN) on contiguous K/V: the reference a paged kernel is measured against. A
mixed shape's prompt and decode rows are also timed apart (`split_times`).

    python bench/attention_tuning.py [--out FILE] [--models qwen3,llama-3.1-8b] [--quick]

Writes JSON: every (model, shape, config) row with TFLOP/s, and per (model, shape) the
default's and the best config's TFLOP/s.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import csrc_triton  # noqa: E402
from bench.common import write_result  # noqa: E402
from minivllm.worker.kv_cache import value_cache  # noqa: E402

MODELS = {  # name: (num_q_heads, num_kv_heads, head_dim)
    "qwen2.5-0.5b": (14, 2, 64),
    "qwen3-0.6b": (16, 8, 128),
    "llama-3.1-8b": (32, 8, 128),
}
SHAPES = {  # name: [(cached prefix, new tokens), ...]
    "w5": [(0, 4096), (0, 4096)],
    "w6": [(0, 8192)],
    # W6 as the engine runs it: a prompt's chunk beside the decode rows of earlier prompts.
    # Tiles that won on "w6" alone (128x128 for head_dim 128) lost W6 end to end here.
    "w6-mixed": [(0, 8192 - 16)] + [(8192 + 16 * i, 1) for i in range(16)],
    # ... in the engine's order (running sequences first), mid-way through W6's prompts
    "w6-engine": [(8192 + 4 * i, 1) for i in range(32)] + [(0, 8192 - 32)],
    "w1": [(0, n) for n in (100, 1024, 333, 768, 512, 150, 900, 421)],
    "chunk": [(6144, 2048)],
}
BLOCK_SIZE = 16  # --block-size; the engine's blocks on a GPU are 64 tokens


def problem(shape, hq, hkv, d, dtype, seed=0, cache_dtype=None, block_size=BLOCK_SIZE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq_lens = [c + n for c, n in shape]
    q_lens = [n for _, n in shape]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.zeros(len(shape), max(need), dtype=torch.int32)
    p = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[p:p + n].to(torch.int32)
        p += n
    dev = "cuda"
    cache_dtype = cache_dtype or dtype
    shape4 = (num_blocks, block_size, hkv, d)
    k_cache = torch.randn(shape4, device=dev).to(cache_dtype)
    v_cache = value_cache(shape4, cache_dtype, torch.device(dev))  # e4m3: stored transposed
    v_cache.copy_(torch.randn(shape4, device=dev).to(cache_dtype))
    T = sum(q_lens)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=dev).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return dict(q=qkv[:, :hq * d].view(T, hq, d), k_cache=k_cache, v_cache=v_cache,
                block_tables=bt.to(dev), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                qsl=torch.tensor(qsl, dtype=torch.int32, device=dev), seq_lens_l=seq_lens,
                q_lens_l=q_lens, scale=d ** -0.5)


def attn_flops(pb, hq, d):
    keys = sum(sum(s - n + j + 1 for j in range(n)) for s, n in zip(pb["seq_lens_l"], pb["q_lens_l"]))
    return 4 * d * hq * keys


def sdpa_refs(pb, hq, hkv, d):
    """Per-sequence SDPA over contiguous K/V (fresh prompts only): time per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    seqs = []
    qsl = pb["qsl"].tolist()
    for i, n in enumerate(pb["q_lens_l"]):
        q = pb["q"][qsl[i]:qsl[i + 1]].transpose(0, 1).contiguous()[None]  # [1, Hq, n, d]
        k = torch.randn(1, hkv, n, d, device="cuda", dtype=q.dtype)
        v = torch.randn_like(k)
        seqs.append((q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)))
    out = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fn():
            with sdpa_kernel(backend):
                for q, k, v in seqs:
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            fn()
            out[name] = bench(fn)
        except Exception as e:  # a backend this build or GPU lacks
            out[name] = f"unavailable: {type(e).__name__}: {str(e)[:120]}"
    return out


def default_config(pb, hq, hkv, d, dtype, cache_dtype):
    """The engine's tile config for a problem (csrc_triton.paged_attention's choice)."""
    return csrc_triton._prefill_config(max(pb["q_lens_l"]), max(pb["seq_lens_l"]), hq // hkv,
                                       d, dtype, False, cache_dtype)


def split_times(shape, hq, hkv, d, dtype, cache_dtype, block_size):
    """A mixed shape's parts timed apart (us): its prompt rows alone through the prefill
    kernel (default config), and its decode rows alone through the prefill kernel and
    through the split-KV decode kernel: what the decode rows cost inside the mixed launch."""
    out = {}
    for name, part in (("prompt_alone", [sn for sn in shape if sn[1] > 1]),
                       ("decode_rows_prefill_kernel", [sn for sn in shape if sn[1] == 1])):
        pb = problem(part, hq, hkv, d, dtype, cache_dtype=cache_dtype, block_size=block_size)
        max_q, max_s = max(pb["q_lens_l"]), max(pb["seq_lens_l"])
        cfg = default_config(pb, hq, hkv, d, dtype, cache_dtype)
        o = torch.empty_like(pb["q"])
        out[f"{name}_us"] = 1e6 * bench(lambda: csrc_triton._launch_prefill(
            pb["q"], pb["k_cache"], pb["v_cache"], pb["block_tables"], pb["seq_lens"],
            pb["qsl"], pb["scale"], o, cfg))
        if max_q == 1:
            out["decode_rows_decode_kernel_us"] = 1e6 * bench(
                lambda: csrc_triton.paged_attention_decode(
                    pb["q"], pb["k_cache"], pb["v_cache"], pb["block_tables"], pb["seq_lens"],
                    pb["scale"], max_s, out=o))
    return out


def bench(fn):
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e-3


def configs(quick, fp8=False):
    ms, ns, ws, ss = ((64, 128), (64, 128), (4, 8), (2, 3)) if quick else \
        ((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    if fp8:  # e4m3 tiles: longer and fewer stages won in the decode kernel
        ms, ns, ws, ss = (64, 128), (64, 128, 256), (4, 8), (1, 2, 3)
    for bm, bn, w, s in itertools.product(ms, ns, ws, ss):
        yield dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="a smaller sweep")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_tuning needs a CUDA GPU")
    dtype = torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dtype
    t0 = time.time()
    rows, summary = [], []
    for model in args.models.split(","):
        hq, hkv, d = MODELS[model]
        for shape_name in args.shapes.split(","):
            shape = SHAPES[shape_name]
            pb = problem(shape, hq, hkv, d, dtype, cache_dtype=cache_dtype,
                         block_size=args.block_size)
            flops = attn_flops(pb, hq, d)
            default_cfg = default_config(pb, hq, hkv, d, dtype, cache_dtype)
            ref = torch.empty_like(pb["q"], memory_format=torch.contiguous_format)

            def launch(cfg, out):
                csrc_triton._launch_prefill(pb["q"], pb["k_cache"], pb["v_cache"], pb["block_tables"],
                                            pb["seq_lens"], pb["qsl"], pb["scale"], out, cfg)
            launch(default_cfg, ref)
            t_default = bench(lambda: launch(default_cfg, ref))
            best = (t_default, dict(default_cfg))
            out = torch.empty_like(ref)
            tried = list(configs(args.quick, fp8=cache_dtype != dtype))
            for cfg in tried + [None]:
                if cfg is None:  # the best tile config again, heavy tiles first
                    cfg = dict(best[1], HEAVY_FIRST=True)
                try:
                    launch(cfg, out)
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = bench(lambda: launch(cfg, out))
                except Exception as e:  # e.g. out of shared memory for this tile
                    rows.append(dict(model=model, shape=shape_name, **cfg, error=f"{type(e).__name__}"))
                    continue
                ok = err < 1e-2
                rows.append(dict(model=model, shape=shape_name, **cfg, t_us=t * 1e6,
                                 TFLOPs=flops / t / 1e12, rel_err_vs_default=err, ok=ok))
                if ok and t < best[0]:
                    best = (t, dict(cfg))
            refs = sdpa_refs(pb, hq, hkv, d) if all(c == 0 for c, _ in shape) else {}
            if any(n == 1 for _, n in shape) and any(n > 1 for _, n in shape):
                refs.update(split_times(shape, hq, hkv, d, dtype, cache_dtype, args.block_size))
            s = dict(model=model, shape=shape_name, tokens=sum(pb["q_lens_l"]), gflop=flops / 1e9,
                     default=default_cfg, default_us=t_default * 1e6,
                     default_TFLOPs=flops / t_default / 1e12,
                     best=best[1], best_TFLOPs=flops / best[0] / 1e12,
                     **{k: (flops / v / 1e12 if isinstance(v, float) else v)
                        for k, v in refs.items() if k.startswith("sdpa")},
                     **{k: v for k, v in refs.items() if not k.startswith("sdpa")})
            summary.append(s)
            print(f"[{time.time() - t0:6.1f}s] {model:13s} {shape_name:6s} default "
                  f"{s['default_TFLOPs']:6.1f}  best {s['best_TFLOPs']:6.1f} {best[1]}  "
                  + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} -"
                              for k, v in s.items() if k.startswith("sdpa")), flush=True)
    path = write_result("attention-tuning", dict(dtype="bfloat16", block_size=args.block_size,
                                                 kv_cache_dtype=str(cache_dtype).split(".")[-1],
                                                 wall_s=time.time() - t0, summary=summary,
                                                 rows=rows), args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
