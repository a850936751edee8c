"""A/B hooks for the device calls (not part of the project)."""
import os

if os.environ.get("AB_INT4_CFG"):
    # "N:K:bn,bm,slices,warps,stages[,split]|..." -> the sliced int4 kernel's config at <= 8 rows
    from csrc_triton import quant_gemm as _qg

    _cfg = {}
    for item in os.environ["AB_INT4_CFG"].split("|"):
        n, k, c = item.split(":")
        _cfg[(int(n), int(k))] = tuple(int(v) for v in c.split(","))
    _orig = _qg.int4_mma_config

    def int4_mma_config(M, N, K, interpreted=False):
        if not interpreted and M <= 8 and (N, K) in _cfg:
            return _cfg[(N, K)]
        return _orig(M, N, K, interpreted)
    _qg.int4_mma_config = int4_mma_config
