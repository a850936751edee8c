#!/usr/bin/env python3
"""Correctness + speed check of the csrc_triton kernels on a CUDA GPU.

For each dtype (bf16, fp16, fp32) and head configuration of real models
(Qwen2.5-0.5B 14/2 heads d64, Llama-3.2-1B 32/8 d64, Qwen3 16/8 d128) it runs

* decode (flash-decoding path): batch 1/8/64/256 at context 1024, batch 1 at
  context 8192 -- timed eagerly and as a CUDA-graph replay, with the achieved
  bandwidth (K/V bytes read + q/out/block-table bytes) against 4.28 TB/s;
* varlen prefill: a ragged batch of prompts of 100..1024 tokens;
* chunked prefill: cached prefixes + new chunks, mixed with decode rows;
* store_kv_cache of 4096 tokens,

compares each against a dense fp32 torch reference (relative error
||out - ref|| / ||ref||) and times it with triton.testing.do_bench (median).
Results go to --out as JSON (versions, GPU name, every row).

    python bench/kernel_check.py [--out bench/results/kernel_check.json] [--full]
    python bench/kernel_check.py --tiny     # CPU smoke test under TRITON_INTERPRET=1

By default fp16 and fp32 run a subset of the shapes (bf16 runs all) to stay
well inside 3 minutes on an H200; --full runs every shape for every dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

PEAK_BW = 4.28e12  # bytes/s, H200 device-to-device copy measured here
MODELS = {  # name: (num_q_heads, num_kv_heads, head_dim)
    "qwen2.5-0.5b": (14, 2, 64),
    "llama-3.2-1b": (32, 8, 64),
    "qwen3": (16, 8, 128),
}
TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join("bench", "results", "kernel_check.json"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, CPU interpreter allowed (smoke test)")
    ap.add_argument("--full", action="store_true", help="every shape for every dtype")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph decode timings")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.tiny and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

try:
    import csrc_triton  # noqa: E402
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import csrc_triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


# ----------------------------------------------------------------------------
# problem construction and references
# ----------------------------------------------------------------------------
def cdiv(a, b):
    return -(-a // b)


class Problem:
    """A KV cache filled with random data, random (permuted) block tables."""

    def __init__(self, seq_lens, q_lens, hq, hkv, d, bs, dtype, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.seq_lens_l, self.q_lens_l = list(seq_lens), list(q_lens)
        self.hq, self.hkv, self.d, self.bs, self.dtype = hq, hkv, d, bs, dtype
        need = [cdiv(s, bs) for s in seq_lens]
        width = max(max(need), 1)
        num_blocks = sum(need) + 8
        perm = torch.randperm(num_blocks, generator=g)
        bt = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        p = 0
        for i, n in enumerate(need):
            bt[i, :n] = perm[p:p + n].to(torch.int32)
            p += n
        dev = DEVICE
        self.block_tables = bt.to(dev)
        shape = (num_blocks, bs, hkv, d)
        self.k_cache = torch.randn(shape, device=dev, dtype=torch.float32).to(dtype)
        self.v_cache = torch.randn(shape, device=dev, dtype=torch.float32).to(dtype)
        T = sum(q_lens)
        # q as a view of a fused qkv projection output (non-contiguous)
        qkv = torch.randn(T, (hq + 2 * hkv) * d, device=dev, dtype=torch.float32).to(dtype)
        self.q = qkv[:, : hq * d].view(T, hq, d)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        self.qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
        self.scale = d ** -0.5
        self.max_q = max(q_lens)
        self.max_s = max(seq_lens)

    def gather(self, cache, i, n):
        pos = torch.arange(n, device=cache.device)
        blk = self.block_tables[i].long()[pos // self.bs]
        return cache[blk, pos % self.bs].float()

    def reference(self):
        """Dense fp32 causal reference, per sequence, GQA without repeats."""
        T, hq, d = self.q.shape
        G = hq // self.hkv
        out = torch.zeros(T, hq, d, dtype=torch.float32, device=self.q.device)
        qsl = self.qsl.tolist()
        for i, sl in enumerate(self.seq_lens_l):
            s, e = qsl[i], qsl[i + 1]
            ql = e - s
            if ql == 0 or sl == 0:
                continue
            k = self.gather(self.k_cache, i, sl)  # [L, Hkv, D]
            v = self.gather(self.v_cache, i, sl)
            qi = self.q[s:e].float().view(ql, self.hkv, G, d)
            sc = torch.einsum("qhgd,lhd->hgql", qi, k) * self.scale
            qpos = torch.arange(sl - ql, sl, device=sc.device)[:, None]
            kpos = torch.arange(sl, device=sc.device)[None, :]
            sc = sc.masked_fill(kpos > qpos, float("-inf"))
            o = torch.einsum("hgql,lhd->qhgd", torch.softmax(sc, -1), v)
            out[s:e] = o.reshape(ql, hq, d)
        return out

    def reference_decode(self):
        """Batched fp32 reference for one query per sequence."""
        B, hq, d = self.q.shape
        G = hq // self.hkv
        L = self.max_s
        pos = torch.arange(L, device=self.q.device)
        blk = self.block_tables.long()[:, pos // self.bs]  # [B, L]
        k = self.k_cache[blk, pos % self.bs].float()  # [B, L, Hkv, D]
        v = self.v_cache[blk, pos % self.bs].float()
        qg = self.q.float().view(B, self.hkv, G, d)
        sc = torch.einsum("bhgd,blhd->bhgl", qg, k) * self.scale
        valid = pos[None, :] < self.seq_lens[:, None].long()
        sc = sc.masked_fill(~valid[:, None, None, :], float("-inf"))
        o = torch.einsum("bhgl,blhd->bhgd", torch.softmax(sc, -1), v)
        return o.reshape(B, hq, d)

    def kv_bytes(self):
        e = self.k_cache.element_size()
        return 2 * sum(self.seq_lens_l) * self.hkv * self.d * e

    def attn_flops(self):
        f = 0
        for sl, ql in zip(self.seq_lens_l, self.q_lens_l):
            ctx = sl - ql
            f += sum(ctx + j + 1 for j in range(ql))  # attended keys
        return 4 * self.d * self.hq * f


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-20)).item()


def bench(fn):
    """Median time in seconds."""
    if DEVICE == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_graph(fn):
    if DEVICE != "cuda" or ARGS.no_graph:
        return None
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    return bench(g.replay) / 10


# ----------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------
def case_decode(model, dtype_name, batch, ctx, rows):
    hq, hkv, d = MODELS[model]
    dtype = DTYPES[dtype_name]
    # slightly ragged contexts around ctx (the max is ctx)
    seq_lens = [ctx - (17 * i) % max(1, ctx // 8) for i in range(batch)]
    pb = Problem(seq_lens, [1] * batch, hq, hkv, d, ARGS.block_size, dtype, seed=batch + ctx)
    out = torch.empty(batch, hq, d, dtype=dtype, device=DEVICE)
    splits = csrc_triton.decode_num_splits(batch, hkv, ctx, pb.q.device)

    def fn():
        csrc_triton.paged_attention(pb.q, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, pb.qsl,
                                    pb.scale, 1, ctx, out=out)

    fn()
    err = rel_err(out, pb.reference_decode())
    t = bench(fn)
    tg = bench_graph(fn)
    e = pb.k_cache.element_size()
    nbytes = pb.kv_bytes() + 2 * batch * hq * d * e + pb.block_tables.numel() * 4 + batch * 4
    best = min(x for x in (t, tg) if x is not None)
    rows.append(dict(kernel="decode", model=model, dtype=dtype_name, batch=batch, ctx=ctx, num_splits=splits,
                     rel_err=err, ok=bool(err < TOL[dtype_name]), t_us=t * 1e6,
                     t_graph_us=None if tg is None else tg * 1e6, bytes=nbytes,
                     GBps=nbytes / best / 1e9, bw_frac=nbytes / best / PEAK_BW))


def case_prefill(model, dtype_name, kind, prompts, rows):
    hq, hkv, d = MODELS[model]
    dtype = DTYPES[dtype_name]
    if kind == "prefill":
        seq_lens, q_lens = prompts, prompts
    else:  # chunked: (cached prefix, new tokens) pairs
        seq_lens = [c + n for c, n in prompts]
        q_lens = [n for _, n in prompts]
    pb = Problem(seq_lens, q_lens, hq, hkv, d, ARGS.block_size, dtype, seed=len(prompts))
    out = torch.empty(sum(q_lens), hq, d, dtype=dtype, device=DEVICE)

    def fn():
        csrc_triton.paged_attention(pb.q, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, pb.qsl,
                                    pb.scale, pb.max_q, pb.max_s, out=out)

    fn()
    err = rel_err(out, pb.reference())
    t = bench(fn)
    flops = pb.attn_flops()
    rows.append(dict(kernel=kind, model=model, dtype=dtype_name, num_seqs=len(q_lens), tokens=sum(q_lens),
                     max_query_len=pb.max_q, max_seq_len=pb.max_s, rel_err=err, ok=bool(err < TOL[dtype_name]),
                     t_us=t * 1e6, TFLOPs=flops / t / 1e12))


def case_store(model, dtype_name, T, rows):
    hq, hkv, d = MODELS[model]
    dtype = DTYPES[dtype_name]
    bs = ARGS.block_size
    nb = cdiv(T, bs) + 4
    g = torch.Generator().manual_seed(T)
    kc = torch.zeros(nb, bs, hkv, d, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    kv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    key = kv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
    val = kv[:, (hq + hkv) * d:].view(T, hkv, d)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[::7] = -1
    slots = slots.to(DEVICE)
    csrc_triton.store_kv_cache(key, val, kc, vc, slots)
    ek = torch.zeros_like(kc).view(-1, hkv, d)
    ev = torch.zeros_like(vc).view(-1, hkv, d)
    m = slots >= 0
    ek[slots[m]] = key[m]
    ev[slots[m]] = val[m]
    ok = torch.equal(ek.view_as(kc), kc) and torch.equal(ev.view_as(vc), vc)
    t = bench(lambda: csrc_triton.store_kv_cache(key, val, kc, vc, slots))
    nbytes = 2 * 2 * int(m.sum()) * hkv * d * kc.element_size() + T * 8
    rows.append(dict(kernel="store_kv_cache", model=model, dtype=dtype_name, tokens=T, ok=bool(ok),
                     rel_err=0.0 if ok else 1.0, t_us=t * 1e6, GBps=nbytes / t / 1e9, bw_frac=nbytes / t / PEAK_BW))


def plan(tiny, full):
    if tiny:
        decode = [(1, 300), (3, 70)]
        prefill = [[10, 33, 1]]
        chunked = [[(20, 5), (7, 1), (40, 17)]]
        store = 20
        return decode, decode, prefill, chunked, store
    decode_all = [(1, 1024), (8, 1024), (64, 1024), (256, 1024), (1, 8192)]
    decode_sub = decode_all if full else [(8, 1024), (256, 1024), (1, 8192)]
    prefill = [[100, 1024, 333, 768, 512, 150, 900, 421]]
    chunked = [[(2048, 512), (1000, 256), (3000, 128), (500, 512)] + [(1500 + 100 * i, 1) for i in range(8)]]
    return decode_all, decode_sub, prefill, chunked, 4096


def main():
    t_start = time.time()
    rows = []
    decode_all, decode_sub, prefills, chunks, store_T = plan(ARGS.tiny, ARGS.full)
    dtypes = [x for x in ARGS.dtypes.split(",") if x]
    models = [x for x in ARGS.models.split(",") if x]
    for dtype_name in dtypes:
        for model in models:
            shapes = decode_all if (dtype_name == "bfloat16" or ARGS.full or ARGS.tiny) else decode_sub
            for batch, ctx in shapes:
                case_decode(model, dtype_name, batch, ctx, rows)
            for p in prefills:
                case_prefill(model, dtype_name, "prefill", p, rows)
            for c in chunks:
                case_prefill(model, dtype_name, "chunked_prefill", c, rows)
            case_store(model, dtype_name, store_T, rows)
            print(f"[{time.time() - t_start:6.1f}s] {dtype_name} {model} done", flush=True)

    info = dict(
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (TRITON_INTERPRET=1)",
        interpreter=INTERPRET, block_size=ARGS.block_size, peak_bw_Bps=PEAK_BW, tiny=ARGS.tiny,
        wall_s=time.time() - t_start, all_ok=all(r["ok"] for r in rows), results=rows,
    )
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump(info, f, indent=1)

    hdr = f"{'kernel':16s} {'model':13s} {'dtype':8s} {'shape':22s} {'relerr':>8s} {'ok':>3s} " \
          f"{'t_us':>8s} {'graph_us':>8s} {'perf':>14s}"
    print(hdr)
    for r in rows:
        if r["kernel"] == "decode":
            shape = f"B={r['batch']} ctx={r['ctx']} s={r['num_splits']}"
            perf = f"{r['GBps']:7.0f} GB/s {100 * r['bw_frac']:3.0f}%"
        elif r["kernel"] == "store_kv_cache":
            shape = f"T={r['tokens']}"
            perf = f"{r['GBps']:7.0f} GB/s"
        else:
            shape = f"n={r['num_seqs']} T={r['tokens']} L={r['max_seq_len']}"
            perf = f"{r['TFLOPs']:7.1f} TFLOP/s"
        tg = r.get("t_graph_us")
        print(f"{r['kernel']:16s} {r['model']:13s} {r['dtype']:8s} {shape:22s} {r['rel_err']:8.1e} "
              f"{'y' if r['ok'] else 'N':>3s} {r['t_us']:8.1f} {'' if tg is None else f'{tg:8.1f}':>8s} {perf:>14s}")
    print(f"all_ok={info['all_ok']} wall={info['wall_s']:.1f}s -> {ARGS.out}")
    return 0 if info["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
