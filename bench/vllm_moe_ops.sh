#!/usr/bin/env bash
# vLLM's MoE ops for the GPU machine's vLLM 0.26 bundle, which leaves them out for size
# (../shared/vllm/MANIFEST.txt: without vllm/_moe_C_stable_libtorch.abi3.so a mixture of
# experts stops at `_moe_C ... topk_softmax`).
#
#   bash bench/vllm_moe_ops.sh      # here, once: .vllm/moe (38.5 MB, xz) from the PyPI wheel
#
# The library comes from vLLM 0.26.0's manylinux_2_28 wheel, the build whose
# _C_stable_libtorch.abi3.so the bundle ships (same SHA-256). .vllm/moe is over the budget of
# a call beside the bundle's other pieces: carry it in a call of its own and copy it to
# /tmp/vb there, as .vllm/a0 and .vllm/a1 are (bench/run_vs_vllm.sh's header); run_vs_vllm.sh
# unpacks /tmp/vb/moe (or a carried .vllm/moe) into $VLLM_SITE before vLLM runs.
set -eu
cd "$(dirname "$0")/.."
[ -f .vllm/moe ] && { echo ".vllm/moe is there"; exit 0; }
mkdir -p .vllm
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi abi3 --platform manylinux_2_28_x86_64 vllm==0.26.0 -d "$tmp"
python3 - "$tmp" <<'PY'
import sys, zipfile, pathlib
tmp = pathlib.Path(sys.argv[1])
wheel = next(tmp.glob("vllm-0.26.0-*.whl"))
zipfile.ZipFile(wheel).extract("vllm/_moe_C_stable_libtorch.abi3.so", tmp / "site")
PY
XZ_OPT="-9e -T2" tar -cJf .vllm/moe -C "$tmp/site" vllm/_moe_C_stable_libtorch.abi3.so
ls -l .vllm/moe
