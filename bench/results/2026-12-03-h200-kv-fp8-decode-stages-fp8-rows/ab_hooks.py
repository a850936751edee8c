# sitecustomize.py on the device's PYTHONPATH for this call: AB_FP8_DECODE_STAGES=N gives
# the e4m3 cache's decode kernel N stages (the other hooks of the session's copy are in
# ../2026-12-03-h200-gemv-l2-prefetch-loop-stages/ab_hooks.py).
import os

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
