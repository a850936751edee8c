import os

# AB_PREFILL_128_LONG=1: head_dim 128's 16-bit prefill tiles on a long query (>= 2048
# tokens) are 128 rows x 64 keys, 4 warps, 2 stages (the w6-engine sweep's best on
# Llama-3.1-8B, GQA 4).
if os.environ.get("AB_PREFILL_128_LONG"):
    import torch
    import csrc_triton as _ct8

    _shipped_prefill_config8 = _ct8._prefill_config

    def _prefill_config8(rows, head_dim, dtype, interpreted, long_ctx=False, long_query=False,
                         cache_dtype=None):
        cfg = _shipped_prefill_config8(rows, head_dim, dtype, interpreted, long_ctx,
                                       long_query, cache_dtype)
        if (64 < head_dim <= 128 and long_query and not interpreted
                and cache_dtype != torch.float8_e4m3fn and dtype != torch.float32):
            cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2)
        return cfg

    _ct8._prefill_config = _prefill_config8
