"""Programmatic dependent launch (PDL, Hopper and newer), shared by every kernel module.

A kernel launched with PDL may start while the kernel before it in the stream still runs:
its programs wait (griddepcontrol.wait) until that kernel has finished and its writes are
visible, and meanwhile can load what no kernel writes, such as weights. Each kernel lets
the next one launch as soon as all its own programs have started. In a decode step of
~300 small kernels this hides the launch gap and the tail of each kernel behind the next
(docs/decisions.md, "Kernels launched early").

The rule that keeps it correct: a kernel launched with PDL calls `wait_for_previous`
before it reads or writes anything another kernel of the step touches, in every program
(an early return before it would let a later kernel overtake). Loaded through
_interpret.jit_helpers, like _fp8_cast.
"""

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With PDL: wait for the previous kernel's results, then let the next kernel launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device, interpreted: bool = False) -> bool:
    """Whether kernels on `device` launch with PDL: compiled kernels on a GPU of compute
    capability 9 or more, unless MINIVLLM_PDL=0."""
    off = os.environ.get("MINIVLLM_PDL", "1").strip().lower() in ("0", "false", "no", "off")
    if interpreted or device.type != "cuda" or off:
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device, interpreted: bool = False) -> dict:
    """A launch's PDL keywords: the kernel's PDL argument and the launch option, or none
    (the kernels' PDL defaults to False)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device, interpreted) else {}
