"""The pool of physical KV-cache blocks: O(1) allocate and free, with reference counts.

A block can be shared (n > 1 samples share their prompt's full blocks); it returns to the
free list when its last holder lets go.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("no free KV-cache blocks")
        block = self._free.popleft()
        self._refcount[block] = 1
        return block

    def share(self, block: int) -> int:
        """Take one more reference on an allocated block."""
        assert self._refcount[block] > 0, f"block {block} is not allocated"
        self._refcount[block] += 1
        return block

    def free(self, block: int) -> None:
        count = self._refcount[block]
        assert count > 0, f"double free of block {block}"
        self._refcount[block] = count - 1
        if count == 1:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks and not any(self._refcount)
