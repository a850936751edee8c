"""Probe: how fast is Triton's causal attention on this GPU on W5's shapes (2 prompts x
4,096 tokens, bf16), by how its K/V tiles are read?

Times, for each model's head layout: the engine's paged kernel (csrc_triton) at KV blocks of
16, 64 and 128 tokens, gathering each tile token by token through the block table or (where
a tile lies inside one block) loading it whole through TMA descriptors, in several tile
configurations; a kernel here over contiguous K/V (the prompts' own k and v) through
descriptors; and torch SDPA (cuDNN, flash). Each output is checked against SDPA.

    python -m bench.diagnostics.fresh_attention_probe --out FILE [--tiny]

--tiny runs the contiguous kernel on a tiny shape (Triton's interpreter on a CPU too).
Results: docs/decisions.md, "KV blocks of 64 tokens" and "Fresh prompts' attention from
their own K/V" (the engine form of the contiguous kernel, at commit cf2563f).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl

SHAPES = {  # (q heads, kv heads, head dim)
    "qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}


@triton.jit
def _softmax_step(acc, m_i, l_i, q, k, v, qk_scale, keep, MASKED: tl.constexpr):
    """One key tile of the online softmax (keep: the [rows, keys] that count, if MASKED)."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _fresh_causal_kernel(q_desc, k_desc, v_desc, o_desc, qk_scale, T,
                         NUM_HEADS: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Causal attention of equal-length sequences laid flat ([B * T, heads * D]), every
    key contiguous: one program per (BLOCK_M query tile, sequence x head), the heaviest
    tiles first. Off-diagonal key tiles unmasked, the diagonal ones masked."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    seq = bh // NUM_HEADS
    head = bh % NUM_HEADS
    kv_col = (head // GQA) * HEAD_DIM
    base = seq * T
    q_row0 = tile * BLOCK_M
    q = q_desc.load([base + q_row0, head * HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, q_row0, BLOCK_N):
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k_desc.load([base + start, kv_col]),
                                      v_desc.load([base + start, kv_col]), qk_scale, None,
                                      False)
    offs_m = q_row0 + tl.arange(0, BLOCK_M)
    for start in range(q_row0, q_row0 + BLOCK_M, BLOCK_N):
        keep = (start + tl.arange(0, BLOCK_N))[None, :] <= offs_m[:, None]
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k_desc.load([base + start, kv_col]),
                                      v_desc.load([base + start, kv_col]), qk_scale, keep,
                                      True)
    o_desc.store([base + q_row0, head * HEAD_DIM], (acc / l_i[:, None]).to(q.dtype))


def fresh_causal(q, k, v, block_m: int, block_n: int, warps: int, stages: int) -> torch.Tensor:
    """q [B*T, H, D], k/v [B*T, Hkv, D] (B sequences of T tokens each, T % block_m == 0)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, H, D = q.shape
    Hkv = k.shape[1]
    T = rows // B_GLOBAL[0]
    o = torch.empty_like(q)
    q2, k2, v2, o2 = (t.reshape(rows, -1) for t in (q, k, v, o))
    qd = TensorDescriptor.from_tensor(q2, [block_m, D])
    kd = TensorDescriptor.from_tensor(k2, [block_n, D])
    vd = TensorDescriptor.from_tensor(v2, [block_n, D])
    od = TensorDescriptor.from_tensor(o2, [block_m, D])
    grid = (T // block_m, B_GLOBAL[0] * H)
    opts = {} if q.device.type == "cpu" else {"num_warps": warps, "num_stages": stages}
    _fresh_causal_kernel[grid](qd, kd, vd, od, D ** -0.5 * math.log2(math.e), T,
                               NUM_HEADS=H, GQA=H // Hkv, HEAD_DIM=D, BLOCK_M=block_m,
                               BLOCK_N=block_n, **opts)
    return o


B_GLOBAL = [1]


def sdpa_reference(q, k, v, B: int) -> torch.Tensor:
    rows, H, D = q.shape
    T = rows // B
    g = H // k.shape[1]
    qh = q.view(B, T, H, D).transpose(1, 2).float()
    kh = k.view(B, T, -1, D).repeat_interleave(g, dim=2).transpose(1, 2).float()
    vh = v.view(B, T, -1, D).repeat_interleave(g, dim=2).transpose(1, 2).float()
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return o.transpose(1, 2).reshape(rows, H, D)


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        B_GLOBAL[0] = 2
        q, k, v = (torch.randn(64, h, 32, device=dev) for h in (4, 2, 2))
        ref = sdpa_reference(q, k, v, 2)
        got = fresh_causal(q, k, v, 16, 16, 4, 2)
        print("tiny max err", (got.float() - ref).abs().max().item())
        return
    import csrc_triton

    B, T = 2, 4096
    B_GLOBAL[0] = B
    rows_out = []
    for model, (H, Hkv, D) in SHAPES.items():
        torch.manual_seed(0)
        q = torch.randn(B * T, H, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B * T, Hkv, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B * T, Hkv, D, device=dev, dtype=torch.bfloat16)
        ref = sdpa_reference(q, k, v, B)
        flops = 4 * B * H * D * T * T / 2
        # The engine's paged kernel on the same prompts (blocks in order), through its
        # per-token gather and through tensor descriptors (whole tiles inside a block).
        lens = torch.full((B,), T, device=dev, dtype=torch.int32)
        qsl = torch.arange(0, B * T + 1, T, device=dev, dtype=torch.int32)
        variants = []
        default_cfg = csrc_triton._prefill_config(T, T, H // Hkv, D, q.dtype, False)
        for bs in (16, 64, 128):
            nblk = B * T // bs
            kc = k.view(nblk, bs, Hkv, D).contiguous()
            vc = v.view(nblk, bs, Hkv, D).contiguous()
            tables = torch.arange(nblk, device=dev, dtype=torch.int32).view(B, T // bs)
            cfgs = [default_cfg] + ([] if bs < 64 else [
                {**default_cfg, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                for bm, bn, w, st in [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4),
                                      (128, 128, 8, 2), (64, 128, 4, 2)]
                if bs % bn == 0])
            for cfg in cfgs:
                for tma in ((False, True) if bs % cfg["BLOCK_N"] == 0 else (False,)):
                    if tma and not csrc_triton._tma_tiles_fit(kc, vc, cfg["BLOCK_N"]):
                        continue
                    name = (f"paged bs{bs} {'tma' if tma else 'gather'} {cfg['BLOCK_M']}x"
                            f"{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
                            f"{' (default)' if cfg is default_cfg else ''}")

                    def paged(kc=kc, vc=vc, tables=tables, cfg=cfg, tma=tma):
                        out = torch.empty_like(q)
                        csrc_triton._launch_prefill(q, kc, vc, tables, lens, qsl, D ** -0.5,
                                                    out, cfg, use_tma=tma)
                        return out
                    variants.append((name, paged))
        for bm, bn, w, st in [(128, 128, 8, 3), (64, 64, 4, 3)]:
            variants.append((f"fresh {bm}x{bn} w{w} s{st}",
                             lambda bm=bm, bn=bn, w=w, st=st: fresh_causal(q, k, v, bm, bn, w, st)))
        g = H // Hkv
        qh = q.view(B, T, H, D).transpose(1, 2)
        kh = k.view(B, T, Hkv, D).repeat_interleave(g, dim=2).transpose(1, 2).contiguous()
        vh = v.view(B, T, Hkv, D).repeat_interleave(g, dim=2).transpose(1, 2).contiguous()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, be in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
            def run(be=be):
                with sdpa_kernel(be):
                    return torch.nn.functional.scaled_dot_product_attention(
                        qh, kh, vh, is_causal=True).transpose(1, 2).reshape(B * T, H, D)
            variants.append((name, run))
        for name, fn in variants:
            try:
                out = fn()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ms = _bench(fn)
                row = {"model": model, "variant": name, "ms": round(ms, 4),
                       "TFLOPs": round(flops / ms / 1e9, 1), "rel_err": err}
            except Exception as e:  # noqa: BLE001 - a variant that does not compile
                row = {"model": model, "variant": name, "error": repr(e)[:300]}
            rows_out.append(row)
            print(row, flush=True)
    if args.out:
        from bench.common import environment
        json.dump({"benchmark": "fresh_attention_probe", "environment": environment(),
                   "B": B, "T": T, "rows": rows_out}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
