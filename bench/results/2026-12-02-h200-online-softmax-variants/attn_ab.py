"""Kernel A/B: the engine's paged attention (default tiles, KV blocks of 64) on W1/W5/W6 shapes,
a chunk after a prefix, mixed steps and decode; csrc_triton from PYTHONPATH (one tree per run)."""
import json, sys, math
import torch, triton
import csrc_triton
from csrc_triton import paged_attention

dev = "cuda"
MODELS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}
# (cached prefix, new tokens) per sequence
SHAPES = {
    "w5": [(0, 4096), (0, 4096)],
    "w6": [(0, 8192)],
    "w6-mixed": [(0, 8192 - 16)] + [(8192 + 16 * i, 1) for i in range(16)],
    "chunk": [(6144, 2048)],
    "w1": [(0, n) for n in (100, 1024, 333, 768, 512, 150, 900, 421)],
    "decode-b64-8k": [(8191, 1)] * 64,
    "decode-b256-1k": [(200 + 7 * i, 1) for i in range(256)],
}
BS = 64
out_rows = []
for model, (H, Hkv, D) in MODELS.items():
    for shape, seqs in SHAPES.items():
        for cache_dtype in ([torch.bfloat16, torch.float8_e4m3fn] if shape.startswith("decode") and model == "llama-3.1-8b" else [torch.bfloat16]):
            torch.manual_seed(0)
            lens = [c + n for c, n in seqs]
            qlens = [n for _, n in seqs]
            need = [-(-s // BS) for s in lens]
            nb = sum(need) + 1
            from minivllm.worker.kv_cache import value_cache
            kc = (torch.randn(nb, BS, Hkv, D, device=dev) * 1.0).to(cache_dtype)
            vc = value_cache((nb, BS, Hkv, D), cache_dtype, torch.device(dev))
            vc.copy_(torch.randn(nb, BS, Hkv, D, device=dev).to(cache_dtype))
            perm = torch.randperm(nb - 1, device=dev).to(torch.int32)
            tables = torch.zeros(len(seqs), max(need), dtype=torch.int32, device=dev)
            p = 0
            for i, n in enumerate(need):
                tables[i, :n] = perm[p:p + n]; p += n
            T = sum(qlens)
            q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
            qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
            sl = torch.tensor(lens, dtype=torch.int32, device=dev)
            scale = D ** -0.5
            fn = lambda: paged_attention(q, kc, vc, tables, sl, qsl, scale, max(qlens), max(lens))
            out = fn(); torch.cuda.synchronize()
            # reference on the last (up to) 32 query rows of the first and last sequence
            errs = []
            for i in sorted({0, len(seqs) - 1}):
                n, s = qlens[i], lens[i]
                rows = min(n, 32)
                blk = tables[i, :need[i]].long()
                kk = kc[blk].reshape(-1, Hkv, D)[:s].float().repeat_interleave(H // Hkv, 1)
                vv = vc[blk].reshape(-1, Hkv, D)[:s].float().repeat_interleave(H // Hkv, 1)
                qq = q[int(qsl[i + 1]) - rows:int(qsl[i + 1])].float()
                sc = torch.einsum("qhd,khd->hqk", qq, kk) * scale
                qpos = torch.arange(s - rows, s, device=dev)[:, None]
                sc = sc.masked_fill(torch.arange(s, device=dev)[None, :] > qpos, float("-inf"))
                ref = torch.einsum("hqk,khd->qhd", sc.softmax(-1), vv)
                got = out[int(qsl[i + 1]) - rows:int(qsl[i + 1])].float()
                errs.append(((got - ref).norm() / ref.norm()).item())
            ms = triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median")
            flops = sum(4 * H * D * sum(c + j + 1 for j in range(n)) if n < 4096 else
                        4 * H * D * (n * c + n * (n + 1) / 2) for c, n in seqs)
            kv_bytes = sum(s for s in lens) * Hkv * D * 2 * kc.element_size()
            r = {"model": model, "shape": shape, "cache": str(cache_dtype).split(".")[-1], "us": round(ms * 1e3, 1),
                 "TFLOPs": round(flops / ms / 1e9, 1), "TBps": round(kv_bytes / ms / 1e9, 2), "rel_err": max(errs)}
            print(json.dumps(r), flush=True); out_rows.append(r)
json.dump({"rows": out_rows, "torch": torch.__version__, "triton": triton.__version__}, open(sys.argv[1], "w"), indent=1)
