# A/B hook: AB_FP8_MM_PICK=FILE makes fp8_mm_config answer from a sweep's picks
# ({"NxK": {"M": config}}): the smallest swept M at or above the step's rows.
import json
import os

_pick = os.environ.get("AB_FP8_MM_PICK")
if _pick:
    from csrc_triton import fp8_mm as _fm

    _picks = json.load(open(_pick))

    _shipped_fp8_mm_config = _fm.fp8_mm_config

    _min_m = int(os.environ.get("AB_FP8_MM_PICK_MIN_M", "0"))

    def fp8_mm_config(M, N, K, sm_count):
        if sm_count is None:
            return (16, 16, 32, 2 if K > 32 else 1, 1, 1)
        if M < _min_m:  # rows below the picks' range: as shipped
            return _shipped_fp8_mm_config(M, N, K, sm_count)
        by_m = _picks.get(f"{N}x{K}", {})
        for m in sorted(int(k) for k in by_m):
            if m >= M:
                c = by_m[str(m)]
                return tuple(c) if c else None
        if os.environ.get("AB_FP8_MM_PICK_FALLBACK"):  # rows past the sweep: as shipped
            return _shipped_fp8_mm_config(M, N, K, sm_count)
        return None

    _fm.fp8_mm_config = fp8_mm_config
