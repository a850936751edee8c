"""A/B hook of the second call (commit 75385c6), on PYTHONPATH as sitecustomize.py: AB_OLD=1
runs the tree as before, AB_RESIDUAL_ONLY=1 keeps the residual epilogue without the next
norm's first half, AB_W16=1 sends 16-bit weights through the epilogue GEMVs too."""
import os

if os.environ.get("AB_OLD") or os.environ.get("AB_RESIDUAL_ONLY") or os.environ.get("AB_W16"):
    import torch
    import csrc_triton
    from minivllm.model import layers, llama

    if os.environ.get("AB_OLD") or os.environ.get("AB_RESIDUAL_ONLY"):
        _orig = layers.add_projection
        _old = bool(os.environ.get("AB_OLD"))

        def add_projection(proj, x, residual, fused_ops, then_norm=None, then=None):
            if _old:
                return proj(x), residual
            return _orig(proj, x, residual, fused_ops)
        llama.add_projection = layers.add_projection = add_projection
    if os.environ.get("AB_W16"):
        def gemv_weight(self, x):
            x = layers.gemv_row(x)
            if (self.fused_ops and isinstance(x, torch.Tensor) and x.is_cuda and x.dim() == 2
                    and x.shape[0] == 1 and x.dtype == self.weight.dtype
                    and x.dtype in (torch.float16, torch.bfloat16)
                    and not torch.compiler.is_compiling()):
                return csrc_triton.GemvWeight(self.weight, None, self.bias, "w16")
            return None
        layers.Linear.gemv_weight = gemv_weight
