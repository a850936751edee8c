"""Speculative decoding with a draft model: a smaller model with the target's tokenizer
proposes the drafts, one decode step per draft.

The draft has its own ModelRunner (weights, KV cache, CUDA graphs) whose KV cache has as
many blocks as the target's, so a sequence's block table serves both: the draft writes its
KV at the same slots in its own tensors, and the blocks the scheduler allocated for a step
of 1 + k tokens hold the draft's k - 1 drafting positions too.

Each sequence records how many of its tokens the draft has in its cache (draft_computed).
Before drafting, the draft catches up on the rest: a new sequence's whole prompt (in
chunks of at most max_num_batched_tokens), later the one or two tokens the last step
added. The draft's KV is valid up to the first rejected draft; a preempted sequence lost
its blocks and starts over. The draft's logits at the last token give the first draft,
and each further draft is one batched decode step of the draft over the one before.
"""

from __future__ import annotations

import torch

from ..engine.sequence import Sequence
from .model_runner import ModelRunner


class DraftModel:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.budget = runner.cfg.max_num_batched_tokens

    def propose(self, seqs: list[Sequence]) -> None:
        """Fill in the drafts of seqs: each ends with num_drafts placeholder tokens, which
        become the draft's tokens. A sampled sequence's draft at a position is drawn with
        the random numbers the target draws that position with (its temperature and
        truncation, without penalties): the closer the two distributions, the likelier
        the same token, and only the same token is accepted."""
        ends = [len(s.token_ids) - s.num_drafts for s in seqs]  # committed tokens
        for seq in seqs:
            if seq.draft_epoch != seq.num_preemptions:  # its blocks were freed
                seq.draft_computed, seq.draft_epoch = 0, seq.num_preemptions
        logits = self._catch_up(seqs, ends)
        greedy = None
        active = list(range(len(seqs)))
        for j in range(max(s.num_drafts for s in seqs)):
            rows = [seqs[i] for i in active]
            tokens = self.runner.sampler.sample_now(logits, greedy, rows,
                                                    [ends[i] + j for i in active]).token_ids
            for r, i in enumerate(active):
                seqs[i].token_ids[ends[i] + j] = tokens[r]
            # The next draft's step: sequences with drafts still to fill.
            active = [i for i in active if seqs[i].num_drafts > j + 1]
            if not active:
                break
            logits, greedy = self.runner.logits_of_chunks(
                [(seqs[i], ends[i] + j, ends[i] + j + 1) for i in active])
        for seq, end in zip(seqs, ends):
            seq.draft_computed = end + seq.num_drafts - 1

    def _catch_up(self, seqs: list[Sequence], ends: list[int]) -> torch.Tensor:
        """Run the draft over each sequence's tokens it has not seen, [draft_computed,
        end), in forwards of at most `budget` tokens; the logits at each one's last token."""
        forwards: list[list[tuple[int, int, int]]] = [[]]
        used = 0
        for i, (seq, end) in enumerate(zip(seqs, ends)):
            start = seq.draft_computed
            while start < end:
                n = min(end - start, self.budget - used)
                forwards[-1].append((i, start, start + n))
                used += n
                start += n
                if used == self.budget:
                    forwards.append([])
                    used = 0
        last_rows = [0] * len(seqs)
        outputs = []
        for chunks in forwards:
            if not chunks:
                continue
            logits, _ = self.runner.logits_of_chunks([(seqs[i], a, b) for i, a, b in chunks])
            for r, (i, _, _) in enumerate(chunks):
                last_rows[i] = (len(outputs), r)
            outputs.append(logits.clone() if len(forwards) > 1 else logits)
        return torch.stack([outputs[f][r] for f, r in last_rows])
