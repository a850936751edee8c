import os

# AB_DECODE_CFG=BN,WARPS,STAGES: the 16-bit cache's decode tiles for head_dim 128.
if os.environ.get("AB_DECODE_CFG"):
    import torch
    import csrc_triton as _ct9

    _bn9, _w9, _s9 = (int(x) for x in os.environ["AB_DECODE_CFG"].split(","))
    _shipped_decode_config9 = _ct9._decode_config

    def _decode_config9(head_dim, dtype, interpreted, cache_dtype=None):
        if (64 < head_dim <= 128 and not interpreted and dtype != torch.float32
                and cache_dtype != torch.float8_e4m3fn):
            return dict(BLOCK_N=_bn9, num_warps=_w9, num_stages=_s9)
        return _shipped_decode_config9(head_dim, dtype, interpreted, cache_dtype)

    _ct9._decode_config = _decode_config9
