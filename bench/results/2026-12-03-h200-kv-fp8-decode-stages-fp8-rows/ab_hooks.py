# A/B hook: AB_GEMV_PICK=FILE replaces gemv_config's answer for the shapes in FILE.
import json
import os

_pick = os.environ.get("AB_GEMV_PICK")
if _pick:
    from csrc_triton import quant_gemm as _qg

    _picks = json.load(open(_pick))
    _orig = _qg.gemv_config

    def gemv_config(fmt, half, N, K, interpreted=False):
        c = _picks.get(fmt, {}).get(f"{N}x{K}")
        return tuple(c) if c and not interpreted else _orig(fmt, half, N, K, interpreted)

    _qg.gemv_config = gemv_config

if os.environ.get("AB_INT4_NO_SPLIT"):
    from csrc_triton import quant_gemm as _qg2

    _orig_path = _qg2.int4_path

    def int4_path(M, N, K, sm_count):
        kind, cfg = _orig_path(M, N, K, sm_count)
        if kind == "tiles" and cfg is not None and len(cfg) == 5:
            return "dense", None
        return kind, cfg

    _qg2.int4_path = int4_path

if os.environ.get("AB_NO_PREFETCH"):
    from csrc_triton import quant_gemm as _qg3

    _qg3.weight_prefetch_args = lambda w, rows, interpreted: {}

if os.environ.get("AB_FP8_DECODE_STAGES"):
    import torch as _torch
    import csrc_triton as _ct

    _orig_dc = _ct._decode_config
    _dst = int(os.environ["AB_FP8_DECODE_STAGES"])

    def _decode_config(head_dim, dtype, interpreted, cache_dtype=None):
        c = dict(_orig_dc(head_dim, dtype, interpreted, cache_dtype))
        if cache_dtype == _torch.float8_e4m3fn and not interpreted:
            c["num_stages"] = _dst
        return c

    _ct._decode_config = _decode_config
