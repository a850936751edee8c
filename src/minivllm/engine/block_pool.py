"""The pool of physical KV-cache blocks: O(1) allocate and free, reference counts, and a
prefix cache.

A block can be shared (n > 1 samples share their prompt's full blocks; requests share a
common prompt prefix); it returns to the free queue when its last holder lets go. A full
block is registered under a hash of its tokens and of everything before them, so a later
request whose prompt starts the same way can take the block instead of recomputing it.
Freed blocks keep their contents and hash until they are reallocated: the free queue is in
least-recently-freed order, so eviction takes the oldest first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Identity of a full block: its tokens and (through the parent) all tokens before."""
    return hash((parent, tuple(tokens)))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        # Free blocks in eviction order (OrderedDict: O(1) pop-front, removal and append).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refcount = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.cache_queries = 0  # full prompt blocks looked up at admission
        self.cache_hits = 0     # of those, taken from the cache

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("no free KV-cache blocks")
        block, _ = self._free.popitem(last=False)
        old = self._hash_of[block]
        if old is not None:  # evict its cached contents
            self._hash_of[block] = None
            if self._cached.get(old) == block:
                del self._cached[old]
        self._refcount[block] = 1
        return block

    def share(self, block: int) -> int:
        """Take one more reference on a block (reviving it if it sits in the free queue)."""
        if self._refcount[block] == 0:
            del self._free[block]
        self._refcount[block] += 1
        return block

    def free(self, block: int) -> None:
        count = self._refcount[block]
        assert count > 0, f"double free of block {block}"
        self._refcount[block] = count - 1
        if count == 1:
            self._free[block] = None

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks and not any(self._refcount)

    # ---- prefix cache -------------------------------------------------------------------

    def register(self, block: int, h: int) -> None:
        """Record that `block` (full, computed) holds the tokens with hash `h`."""
        if self._hash_of[block] is None and h not in self._cached:
            self._hash_of[block] = h
            self._cached[h] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: later lookups find none until blocks are registered
        again. Blocks in use stay with their holders (nothing is freed or moved)."""
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The cached blocks for the longest prefix of `hashes` (no references taken)."""
        found = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def num_reusable_free(self, blocks: Sequence[int]) -> int:
        """How many of these cached blocks sit in the free queue (taking them uses up
        free capacity)."""
        return sum(1 for b in blocks if self._refcount[b] == 0)
