"""Continuous batching: which sequences run in the next step, and with how many tokens.

Every step has a token budget (max_num_batched_tokens) and a cap on running sequences
(max_num_seqs). Running sequences go first, in admission order (a decode costs one token; a
prompt still being prefilled in chunks takes what the budget allows); then waiting
sequences are admitted while budget, sequence slots and blocks last. When a running
sequence needs a block and none is free, the most recently admitted running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later from its prompt plus the tokens it has already produced.

With a sliding window in every layer (Mistral, Phi-3 with a window shorter than
max_model_len), a running sequence's blocks that lie wholly before the window of the next
token it computes are never read again: they go back to the pool as soon as the step
that moves past them is recorded (`advance`), and their table entries become HOLE (the
table stays positional: block i holds positions i*bs..). A sequence then holds
len(block_table) - num_dropped_blocks blocks, about window / block_size + 1, whatever
its length; the scheduler's budget counts only those (the pool's free count).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool, block_hash
from .sequence import Sequence, SequenceStatus

# A block-table entry whose block went back to the pool (out of the sliding window).
HOLE = -1


@dataclass
class ScheduledBatch:
    """One step's work. seqs[i] computes num_new_tokens[i] tokens starting at its
    num_computed_tokens. A decode-only batch (every entry a running sequence's one next
    token) is what the model runner pads to a CUDA-graph bucket, and what it can launch
    behind a pending step reading every input token from that step."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Every entry computes exactly the last token of a running sequence (kept by add()).
    is_decode_only: bool = True

    def add(self, seq: Sequence, n: int, admitted: bool = False) -> None:
        """admitted: seq joins the running ones this step (a prompt all cached but its
        last token computes one token too, yet no earlier step sampled that token)."""
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        if admitted or n != 1 or seq.num_computed_tokens != len(seq.token_ids) - 1:
            self.is_decode_only = False

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether seqs[i] reaches the end of its known tokens this step (and so samples)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.pool = BlockPool(num_blocks)
        # Every layer's window (None: some layer sees all): blocks before it are freed.
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # Keep a few blocks back when admitting new work so running sequences can grow
        # without immediately preempting what was just admitted.
        self.watermark_blocks = max(1, num_blocks // 100) if num_blocks > 16 else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the queues for good and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        seq.status = SequenceStatus.FINISHED

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start a sibling sample after the parent's prompt is prefilled.

        The child shares the parent's full prompt blocks (reference counted) and recomputes
        only the partial last block, so no block is ever written by two sequences and no
        copy-on-write is needed."""
        full_blocks = child.num_prompt_tokens // self.block_size
        child.block_table = [b if b == HOLE else self.pool.share(b)
                             for b in parent.block_table[:full_blocks]]
        child.num_dropped_blocks = min(parent.num_dropped_blocks, full_blocks)
        child.num_computed_tokens = full_blocks * self.block_size
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    # ---- the step ---------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_computed_tokens >= self.max_model_len:
                # A prompt that filled the context (offline): its one token, drawn from
                # the last position, has no position left; it ends on "length" once read.
                i += 1
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not self._reserve(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, n)
                budget -= n
                i += 1

        # Admit new work only in steps without preemption: blocks are short.
        while self.waiting and budget > 0 and not batch.preempted:
            seq = self.waiting[0]
            slots = seq.params.n if seq.forks_pending else 1
            if self.running and self._occupied() + slots > self.max_num_seqs:
                break
            cached = self._cached_prefix(seq)
            computed = len(cached) * self.block_size
            n = len(seq.token_ids) - computed
            if n > budget and not self.enable_chunked_prefill:
                break
            n = min(n, budget)
            reserve = self.watermark_blocks if self.running else 0
            need = (self.blocks_needed(computed + n) - len(cached)
                    + self.pool.num_reusable_free(cached))
            if need > self.pool.num_free - reserve:
                break
            if cached:
                seq.block_table = [self.pool.share(b) for b in cached]
                seq.num_computed_tokens = computed
                self.pool.cache_hits += len(cached)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = computed
            self._reserve(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n, admitted=True)
            budget -= n
        return batch

    def _occupied(self) -> int:
        """Running sequences, and the samples still to fork from the ones prefilling their
        prompt: the step that ends such a prompt samples all of them."""
        return len(self.running) + sum(s.params.n - 1 for s in self.running
                                       if s.forks_pending)

    def advance(self, batch: ScheduledBatch) -> None:
        """Record that the batch's tokens now sit in the KV cache, and offer the blocks
        this step filled to the prefix cache."""
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if not seq.block_table:
                continue  # finished while its step was in flight (pipelined decoding)
            old = seq.num_computed_tokens
            seq.num_computed_tokens = new = old + n
            if self.enable_prefix_caching and new // bs > old // bs:
                hashes = self._hashes(seq, new // bs)
                for i in range(old // bs, new // bs):
                    self.pool.register(seq.block_table[i], hashes[i])
            if self.sliding_window is not None:
                self._drop_out_of_window(seq)

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Free the blocks wholly before the window of the next token the sequence
        computes (position num_computed_tokens sees keys from num_computed_tokens -
        window + 1 on; later tokens see less). A step launched ahead of this one reads
        them first: the device runs steps in launch order, and a freed block is written
        only by a step launched later."""
        computed = seq.num_computed_tokens
        if seq.forks_pending:  # its samples will recompute the prompt's partial last block
            computed = min(computed, seq.num_prompt_tokens // self.block_size * self.block_size)
        first_needed = computed - self.sliding_window + 1
        upto = min(max(0, first_needed) // self.block_size, len(seq.block_table))
        table = seq.block_table
        for i in range(seq.num_dropped_blocks, upto):
            self.pool.free(table[i])
            table[i] = HOLE
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, upto)

    # ---- prefix cache -----------------------------------------------------------------

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of the sequence's first num_blocks full blocks (extended lazily)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None,
                                     seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that can stand for the start of a sequence being admitted. The
        last token is always computed (its logits are needed), and requests that want
        prompt logprobs compute everything."""
        if (not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table
                or seq.request.wants_prompt_logprobs):
            return []
        usable = (len(seq.token_ids) - 1) // self.block_size
        hashes = self._hashes(seq, usable)[:usable]
        self.pool.cache_queries += len(hashes)
        return self.pool.lookup(hashes)

    # ---- blocks -----------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _reserve(self, seq: Sequence, n: int, keep_free: int = 0) -> bool:
        held = len(seq.block_table)
        total = seq.num_computed_tokens + n
        if total <= held * self.block_size:
            return True  # the common decode step: room left in the last block
        need = -(-total // self.block_size) - held
        if need > self.pool.num_free - keep_free:
            return False
        for _ in range(need):
            seq.block_table.append(self.pool.allocate())
        return True

    def _free_blocks(self, seq: Sequence) -> None:
        # Tail first: the free queue evicts oldest first, and a prefix's later blocks are
        # the least likely to be shared.
        for block in reversed(seq.block_table):
            if block != HOLE:
                self.pool.free(block)
        seq.block_table = []
        seq.num_dropped_blocks = 0

    def _preempt(self, seq: Sequence) -> None:
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
