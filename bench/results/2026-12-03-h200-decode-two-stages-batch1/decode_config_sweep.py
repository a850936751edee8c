"""bf16-cache decode attention (Llama-3.1-8B heads) by tile config: batch-1 points through
the engine graph's launch (planned for 8704 positions), 64 x 8192 through the plan."""
import json, sys
import torch
import csrc_triton
from bench.diagnostics.decode_splits import make_layer, replay_us, D, HKV
from bench.common import environment

shipped = csrc_triton._decode_config
configs = [None, (128, 4, 2), (128, 4, 3), (64, 4, 2), (32, 4, 3), (128, 8, 2)]
points = [(1, 128, 8704), (1, 256, 8704), (1, 384, 8704), (1, 1024, 8704), (8, 512, 8704),
          (64, 8192, 8192), (64, 1000, 8704)]
rows = []
dev = torch.device("cuda")
for cfg in configs:
    if cfg is None:
        csrc_triton._decode_config = shipped
    else:
        bn, w, s = cfg
        csrc_triton._decode_config = lambda *a, bn=bn, w=w, s=s, **k: dict(
            BLOCK_N=bn, num_warps=w, num_stages=s)
    csrc_triton._occupancy_cache.clear()
    for batch, ctx, grid_len in points:
        q, k, v, tables, lens = make_layer(batch, ctx, torch.bfloat16, dev)
        out = torch.empty_like(q)
        counters = torch.zeros(batch * HKV, dtype=torch.int32, device=dev)
        plan = csrc_triton.decode_split_plan(q, k, v, tables, lens, grid_len, counters)
        us = replay_us(lambda: csrc_triton.paged_attention_decode(
            q, k, v, tables, lens, D ** -0.5, grid_len, out=out, counters=counters))
        rows.append(dict(config=cfg or "shipped", batch=batch, context=ctx, grid_len=grid_len,
                         splits=plan[0], us=round(us, 2)))
        print(rows[-1], flush=True)
json.dump({"benchmark": "decode_config_bf16", "environment": environment(), "rows": rows},
          open(sys.argv[1], "w"), indent=1)
