"""K split between a kernel's programs (fp8_mm.py's W8A8 kernel, quant_gemm.py's sliced
int4 kernel): each program writes its fp32 partial tile, counts itself in at the tile's
counter, and the one that counts last adds the partials in a fixed order (deterministic,
whichever program came last; atomics on the output would make the sum's order vary, and a
second kernel would cost a launch) and zeroes the counter for the next launch. The
counters live in one buffer per device; the engine runs its kernels on one stream, so no
two launches use them at once. Loaded through _interpret.jit_helpers, like _pdl.
"""

import torch
import triton
import triton.language as tl

# At most this many tiles split at once.
MAX_SPLIT_TILES = 4096
_counters: dict[torch.device, torch.Tensor] = {}


def split_buffers(split: int, M: int, N: int, tiles: int, device: torch.device,
                  what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [split, M, N], the counters) of a launch whose `tiles` output tiles
    each have K split in `split`."""
    if tiles > MAX_SPLIT_TILES:
        raise ValueError(f"{what}: {tiles} tiles split along K, more than the "
                         f"{MAX_SPLIT_TILES} counters")
    return (torch.empty((split, M, N), dtype=torch.float32, device=device),
            split_counters(device))


def split_counters(device: torch.device) -> torch.Tensor:
    found = _counters.get(device)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K counters are made on the first split launch, "
                               "which must not be inside a CUDA-graph capture: run the step "
                               "once before capturing it")
        found = _counters[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32,
                                                device=device)
    return found


@triton.jit
def sum_of_partials(acc, part_ptr, count_ptr, tile, tile_at, ok, split, part_size,
                    SPLIT_K: tl.constexpr):
    """(the sum of the tile's SPLIT_K partials for the program that counts last, else acc;
    whether this program is the last): acc is this program's fp32 partial, stored at
    part_ptr + split * part_size + tile_at (where ok)."""
    tl.store(part_ptr + split * part_size + tile_at, acc, mask=ok)
    tl.debug_barrier()  # every thread's partial stored before the count (release)
    last = tl.atomic_add(count_ptr + tile, 1) == SPLIT_K - 1
    if last:
        acc = tl.full(acc.shape, 0.0, tl.float32)
        for p in range(SPLIT_K):  # a fixed order, whichever program came last
            acc += tl.load(part_ptr + p * part_size + tile_at, mask=ok, other=0.0,
                           cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)
    return acc, last
