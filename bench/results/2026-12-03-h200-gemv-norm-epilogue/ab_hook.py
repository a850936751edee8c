import os

# AB_NO_NORM_EPILOGUE=1: o and down followed by the separate add + norm kernel (the tree
# before the norm epilogue, launch for launch). AB_W16_NORM_EPILOGUE=1: 16-bit weights
# take the norm epilogue too (the other epilogues stay off for them).
if os.environ.get("AB_NO_NORM_EPILOGUE") or os.environ.get("AB_W16_NORM_EPILOGUE"):
    import torch as _torch4
    import csrc_triton as _ct4
    from minivllm.model import llama as _llama
    from minivllm.model.layers import Linear as _Linear

    _shipped_pan = _llama.project_add_and_norm

    def project_add_and_norm(proj, x, residual, norm, fused_ops, then=None):
        if os.environ.get("AB_NO_NORM_EPILOGUE"):
            return _llama.add_and_norm(proj(x), residual, norm, fused_ops, then)
        if (fused_ops and isinstance(proj, _Linear) and isinstance(x, _torch4.Tensor)
                and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
                and x.dtype == proj.weight.dtype
                and x.dtype in (_torch4.bfloat16, _torch4.float16)):
            w = _ct4.GemvWeight(proj.weight, None, proj.bias, "w16")
            return _ct4.gemv_add_rms_norm(x, w, residual, norm.weight, norm.eps), residual
        return _shipped_pan(proj, x, residual, norm, fused_ops, then)

    _llama.project_add_and_norm = project_add_and_norm
