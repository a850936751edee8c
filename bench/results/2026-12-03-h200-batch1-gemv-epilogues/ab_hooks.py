# AB_NO_EPILOGUES=1: the batch-1 epilogue GEMVs replaced by the plain GEMV and the kernel
# after it (the tree before them, launch for launch).
if os.environ.get("AB_NO_EPILOGUES"):
    import torch as _torch
    import csrc_triton as _ct
    from csrc_triton import quant_gemm as _qg

    def _plain(x, w):
        if w.fmt == "w16":
            return _ct.linear_gemv(x, w.codes, w.bias)
        if w.fmt == "fp8":
            return _ct.fp8_weight_gemm(x, w.codes.view(_torch.float8_e4m3fn), w.scale, w.bias)
        return _ct.int8_gemm(x, w.codes, w.scale, w.bias)

    def _silu(x, w):
        return _ct.silu_and_mul(_plain(x, w))

    def _rotary(x, w, positions, cos, sin, q_size, kv_size, kc, vc, slots):
        d = cos.shape[1]
        q, k, v = _plain(x, w).split([q_size, kv_size, kv_size], dim=-1)
        q, _ = _ct.rotary_embedding(positions, q.view(-1, q_size // d, d),
                                    k.view(-1, kv_size // d, d), cos, sin,
                                    v=v.view(-1, kv_size // d, d), k_cache=kc, v_cache=vc,
                                    slot_mapping=slots)
        return q.reshape(1, q_size)

    _qg.gemv_silu_and_mul, _qg.gemv_rotary = _silu, _rotary

# AB_W16_EPILOGUES=rotary: for 16-bit weights only the rotary epilogue (SiLU x up plain).
if os.environ.get("AB_W16_EPILOGUES") == "rotary":
    import csrc_triton as _ct2
    from csrc_triton import quant_gemm as _qg2

    _silu_epilogue = _qg2.gemv_silu_and_mul

    def _silu_w16_plain(x, w):
        if w.fmt == "w16":
            return _ct2.silu_and_mul(_ct2.linear_gemv(x, w.codes, w.bias))
        return _silu_epilogue(x, w)

    _qg2.gemv_silu_and_mul = _silu_w16_plain
