"""A/B hook of the first call (commit 168a6aa), on PYTHONPATH as sitecustomize.py: AB_OLD=1
runs the tree as before (no norm in the GEMVs, no residual epilogue), AB_RESIDUAL_ONLY=1
keeps the residual epilogue but normalizes with the norm kernel."""
import os

if os.environ.get("AB_OLD") or os.environ.get("AB_RESIDUAL_ONLY"):
    from minivllm.model import layers, llama

    _orig = llama.add_and_norm

    def add_and_norm(x, residual, norm, fused_ops, then=None, gemv_by=None):
        return _orig(x, residual, norm, fused_ops, then)
    llama.add_and_norm = add_and_norm
    if os.environ.get("AB_OLD"):
        def add_projection(proj, x, residual, fused_ops):
            return proj(x), residual
        llama.add_projection = layers.add_projection = add_projection
