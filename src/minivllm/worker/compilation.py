"""torch.compile for the graphed decode step (MINIVLLM_COMPILE=1), and where its artifacts
are kept.

The decode graph runner compiles its step once over a dynamic batch dimension and captures
every bucket's CUDA graph from that one function. Inductor's compiled graphs
and kernels go to a cache on disk (`$MINIVLLM_CACHE_DIR/torch-compile`, unless
TORCHINDUCTOR_CACHE_DIR is set), keyed by torch on the traced graph, the shapes and the
versions: a second start of the same model skips code generation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# Read at import: torch writes its default into the variable the first time it looks.
_CACHE_DIR_GIVEN = bool(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))


def use_disk_cache() -> str:
    """Point Inductor's cache at minivllm's cache folder (once, before the first compile);
    returns the folder."""
    if not _CACHE_DIR_GIVEN:
        from ..default_model import cache_dir
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "torch-compile")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_step(fn: Callable) -> Callable:
    """fn compiled with dynamic shapes. Each engine instance compiles its own steps; the
    recompile limit is raised so later engines in one process are not silently eager."""
    from torch import _dynamo
    _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)
    folder = use_disk_cache()
    logger.debug("torch.compile cache: %s", folder)
    return torch.compile(fn, dynamic=True, fullgraph=False)
