"""W1 with kv_cache_dtype=fp8 and the e4m3 decode tiles given: BLOCK_N/warps/stages."""
import sys
import torch
import csrc_triton
bn, w, st = (int(x) for x in sys.argv[1].split("/"))
orig = csrc_triton._decode_config
def patched(head_dim, dtype, interpreted, cache_dtype=None):
    if cache_dtype == torch.float8_e4m3fn and not interpreted:
        return dict(BLOCK_N=bn, num_warps=w, num_stages=st)
    return orig(head_dim, dtype, interpreted, cache_dtype)
csrc_triton._decode_config = patched
from bench.vs_vllm import main
sys.exit(main(["offline", "--engine", "minivllm", "--model", "llama-3.1-8b", "--workloads", sys.argv[3] if len(sys.argv) > 3 else "w1",
               "--kv-cache-dtype", "fp8", "--out", sys.argv[2]]))
