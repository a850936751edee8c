"""Loading a second copy of a kernel module under Triton's interpreter.

CPU tensors can only run Triton kernels through the interpreter, and Triton decides
between compiled and interpreted when a kernel is defined (TRITON_INTERPRET at import).
So a module whose kernels must serve both CUDA and CPU tensors is imported normally for
CUDA and loaded once more, from the same file, with the interpreter switched on.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def load_interpreted_copy(path: str, module_name: str) -> ModuleType:
    """Execute the Python file at `path` as module `module_name` with
    TRITON_INTERPRET=1 (restored afterwards) and return it."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    mod = importlib.util.module_from_spec(spec)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        sys.modules[module_name] = mod
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod


_helper_copies: dict[str, ModuleType] = {}


def jit_helpers(name: str) -> ModuleType:
    """csrc_triton's module `name` of @triton.jit helpers, for a kernel module to call:
    its interpreted copy while an interpreted copy is being loaded (TRITON_INTERPRET=1),
    else the module itself. A kernel may only call helpers of its own kind."""
    import importlib

    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return importlib.import_module(f"csrc_triton.{name}")
    if name not in _helper_copies:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        _helper_copies[name] = load_interpreted_copy(path, f"csrc_triton.{name}_interpreted")
    return _helper_copies[name]
