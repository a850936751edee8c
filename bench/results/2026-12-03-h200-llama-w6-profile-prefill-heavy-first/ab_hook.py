import os

# AB_HEAVY_FIRST_128=1: head_dim 128's 16-bit prefill tiles also run a long query's
# heaviest tiles first (HEAVY_FIRST, as head_dim 64's do).
if os.environ.get("AB_HEAVY_FIRST_128"):
    import csrc_triton as _ct6

    _shipped_prefill_config = _ct6._prefill_config

    def _prefill_config(rows, head_dim, dtype, interpreted, long_ctx=False, long_query=False,
                        cache_dtype=None):
        cfg = _shipped_prefill_config(rows, head_dim, dtype, interpreted, long_ctx,
                                      long_query, cache_dtype)
        if 64 < head_dim <= 128 and "HEAVY_FIRST" not in cfg and not interpreted:
            cfg = dict(cfg, HEAVY_FIRST=long_query)
        return cfg

    _ct6._prefill_config = _prefill_config
