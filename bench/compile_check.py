"""Compile the sampler's Triton kernels for a GPU target on a machine without one.

Triton's interpreter (the CPU tests) runs a kernel as Python and accepts code the compiler
refuses (a global that is not a constexpr, say); a GPU run then fails on its first launch.
This runs `csrc_triton.sampling.sample_rows` once under the interpreter on a small mixed
batch, takes each kernel's argument types and constants from that call, and compiles each
kernel for the target (sm_90, the H100 and H200, by default) in a second process.

    python -m bench.compile_check [--arch 90]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _arg_type(value) -> str:
    import torch
    if isinstance(value, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
                      torch.bfloat16: "bf16", torch.float16: "fp16"}[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2 ** 31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def capture_signatures() -> dict:
    """{kernel: (argument types, constexprs and launch options)} of one sample_rows call
    on the CPU: rows of every kind, logprobs on, so that every kernel launches."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from csrc_triton._interpret import kernels_for
    from minivllm import SamplingParams
    from minivllm.worker import sampler as S

    mod, _ = kernels_for("csrc_triton.sampling", torch.device("cpu"))
    found: dict = {}

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                types = dict(zip(self.kernel.arg_names, map(_arg_type, args)))
                found.setdefault(self.name, (types, kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in [n for n in vars(mod) if n.endswith("_kernel")]:
        setattr(mod, name, Recorder(name, getattr(mod, name)))
    vocab = 3000
    settings = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.2),
                dict(temperature=0.8, top_k=20, top_p=0.9, seed=1), dict(temperature=1.0),
                dict(temperature=0.7, top_p=0.5, seed=3), dict(temperature=0.9, min_p=0.1),
                dict(temperature=1.1, top_k=2000, logprobs=2)]
    rows = []
    for i, kw in enumerate(settings):
        params = SamplingParams(**kw)
        params._eos_token_ids = frozenset([0])
        rows.append(S._CheckRow(i, params, [1 + i, 5, 7], [9, 9, 11]))
    cpu = torch.device("cpu")
    sampler = S.Sampler(vocab, cpu, max_rows=len(rows), num_slots=len(rows))
    sampler.scratch = S._Scratch(len(rows), vocab, cpu)
    sampler.out = S._Outputs(len(rows), vocab, cpu)
    sampler.stage(rows, [6] * len(rows))
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0)) * 3
    sampler.launch(logits, logits.argmax(-1), len(rows), True)
    return found


def compile_all(signatures: dict, arch: int) -> int:
    """Compile each kernel for sm_<arch>; the count that failed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import csrc_triton.sampling as kernels

    failed = 0
    for name, (types, kwargs) in sorted(signatures.items()):
        constexprs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        signature = dict(types, **{k: "constexpr" for k in constexprs})
        try:
            triton.compile(ASTSource(fn=getattr(kernels, name), signature=signature,
                                     constexprs=constexprs),
                           target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": kwargs.get("num_warps", 4)})
            print(f"ok    {name}")
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAIL  {name}: {e}")
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    p.add_argument("--signatures", help=argparse.SUPPRESS)  # the compiling process's input
    args = p.parse_args()
    if args.signatures:  # the second process: compiled kernels, not interpreted ones
        with open(args.signatures) as f:
            return 1 if compile_all(json.load(f), args.arch) else 0
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(capture_signatures(), f)
    env = dict(os.environ, TRITON_INTERPRET="0")
    try:
        return subprocess.call([sys.executable, "-m", "bench.compile_check", "--arch",
                                str(args.arch), "--signatures", f.name], env=env)
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    raise SystemExit(main())
