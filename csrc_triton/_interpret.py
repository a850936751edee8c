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
_kernel_modules: dict[tuple[str, bool], tuple[ModuleType, bool]] = {}


def _interpreted(mod: ModuleType) -> bool:
    return any(type(v).__name__ == "InterpretedFunction" for v in vars(mod).values())


def kernels_for(module_name: str, device) -> tuple[ModuleType, bool]:
    """(the kernel module `module_name` for tensors on `device`, whether its kernels are
    interpreted): the module itself for CUDA tensors (interpreted already if
    TRITON_INTERPRET=1 was set when it was imported), an interpreted copy of it, loaded
    once, for CPU tensors. Looked up once per module and kind of device (every launch
    asks)."""
    key = (module_name, device.type == "cpu")
    found = _kernel_modules.get(key)
    if found is None:
        mod = sys.modules[module_name]
        if key[1] and not _interpreted(mod):
            mod = load_interpreted_copy(os.path.abspath(mod.__file__),
                                        module_name + "_interpreted")
        found = _kernel_modules[key] = (mod, _interpreted(mod))
    return found


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
