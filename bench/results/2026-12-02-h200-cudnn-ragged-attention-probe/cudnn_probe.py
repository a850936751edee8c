"""Probe: torch's cuDNN attention over a ragged batch (cum_seq offsets) on W5/W6/W1 shapes,
GQA native vs heads expanded, against the engine's paged Triton kernel; CUDA-graph capture."""
import json, sys, time, traceback
import torch
import torch.nn.functional as F
import triton
sys.path.insert(0, ".")
import csrc_triton

dev = "cuda"
MODELS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}
SHAPES = {"w5": [4096, 4096], "w6": [8192], "w1": [100, 1024, 333, 768, 512, 150, 900, 421]}
rows = []
def log(r):
    print(json.dumps(r), flush=True); rows.append(r)

def ref_attn(q, k, v, lens, scale):
    outs, s = [], 0
    g = q.shape[1] // k.shape[1]
    for n in lens:
        qq = q[s:s+n].transpose(0, 1)[None].float()
        kk = k[s:s+n].repeat_interleave(g, 1).transpose(0, 1)[None].float()
        vv = v[s:s+n].repeat_interleave(g, 1).transpose(0, 1)[None].float()
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)[0].transpose(0, 1))
        s += n
    return torch.cat(outs)

def cudnn_ragged(q, k, v, cum, max_len, scale, expand):
    if expand:
        g = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(g, 1); v = v.repeat_interleave(g, 1)
    out = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cum, cum, max_len, max_len,
                                                  False, 0.0, True, False, scale=scale)[0]
    return out

def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

for model, (H, Hkv, D) in MODELS.items():
    for shape, lens in SHAPES.items():
        torch.manual_seed(0)
        T = sum(lens)
        scale = D ** -0.5
        q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, Hkv, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(T, Hkv, D, device=dev, dtype=torch.bfloat16)
        cum = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
        ref = ref_attn(q, k, v, lens, scale)
        flops = sum(4 * H * D * n * (n + 1) / 2 for n in lens)
        # paged triton baseline (blocks of 64, in order)
        bs = 64
        need = [-(-n // bs) for n in lens]
        nblk = sum(need)
        kc = torch.zeros(nblk, bs, Hkv, D, device=dev, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        tables = torch.zeros(len(lens), max(need), dtype=torch.int32, device=dev)
        b0 = 0
        for i, n in enumerate(lens):
            s0 = int(cum[i])
            flat_k = kc[b0:b0 + need[i]].view(-1, Hkv, D); flat_k[:n] = k[s0:s0 + n]
            flat_v = vc[b0:b0 + need[i]].view(-1, Hkv, D); flat_v[:n] = v[s0:s0 + n]
            tables[i, :need[i]] = torch.arange(b0, b0 + need[i], dtype=torch.int32)
            b0 += need[i]
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        def triton_fn():
            return csrc_triton.paged_attention(q, kc, vc, tables, seq_lens, cum, scale, max(lens), max(lens))
        variants = [("triton paged", triton_fn)]
        for expand in (False, True):
            variants.append((f"cudnn ragged {'expanded' if expand else 'gqa'}",
                             lambda expand=expand: cudnn_ragged(q, k, v, cum, max(lens), scale, expand)))
            variants.append((f"cudnn ragged {'expanded' if expand else 'gqa'} maxlen8192",
                             lambda expand=expand: cudnn_ragged(q, k, v, cum, 8192, scale, expand)))
        for name, fn in variants:
            try:
                out = fn(); torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ms = bench(fn)
                log({"model": model, "shape": shape, "variant": name, "ms": round(ms, 4),
                     "TFLOPs": round(flops / ms / 1e9, 1), "rel_err": err})
            except Exception as e:
                log({"model": model, "shape": shape, "variant": name, "error": repr(e)[:400]})
        # graph capture: max 8192, capture with w1's offsets, replay with another ragged set
        if shape == "w1":
            for expand in (False, True):
                try:
                    cum_buf = cum.clone()
                    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for _ in range(2):
                            cudnn_ragged(q, k, v, cum_buf, 8192, scale, expand)
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        gout = cudnn_ragged(q, k, v, cum_buf, 8192, scale, expand)
                    lens2 = [200, 2000, 50, 900, 100, 300, 600, 458]
                    assert sum(lens2) == T
                    cum_buf.copy_(torch.tensor([0] + list(torch.tensor(lens2).cumsum(0)), dtype=torch.int32))
                    g.replay(); torch.cuda.synchronize()
                    ref2 = ref_attn(q, k, v, lens2, scale)
                    err = ((gout.float() - ref2).norm() / ref2.norm()).item()
                    log({"model": model, "variant": f"graph replay {'expanded' if expand else 'gqa'}", "rel_err": err})
                except Exception as e:
                    log({"model": model, "variant": f"graph replay {'expanded' if expand else 'gqa'}",
                         "error": repr(e)[:400] + traceback.format_exc()[-600:]})
json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "rows": rows},
          open(sys.argv[1], "w"), indent=1)
