import os

# AB_GEMV_TILES="fmt:NxK=t,fmt:*=t": tiles of weights the batch-1 GEMV loads before the
# PDL wait, by format and shape (first match; unmatched keep the shipped rule).
_gt = os.environ.get("AB_GEMV_TILES")
if _gt:
    from csrc_triton import quant_gemm as _qg3

    _rules = [(k.split(":")[0], k.split(":")[1], int(v))
              for k, v in (e.split("=") for e in _gt.split(","))]
    _shipped_tiles = _qg3.gemv_first_tiles

    def gemv_first_tiles(fmt, N, K, block_k):
        for f, shape, t in _rules:
            if f == fmt and shape in ("*", f"{N}x{K}"):
                return _qg3._usable_tiles(t, K, block_k)
        return _shipped_tiles(fmt, N, K, block_k)

    _qg3.gemv_first_tiles = gemv_first_tiles
