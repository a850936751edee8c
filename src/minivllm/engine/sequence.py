"""Request and sequence state.

A Request is what a user submitted: one prompt and its SamplingParams. It owns n
Sequences, one per sample. The scheduler works on Sequences: each has its own tokens,
block table and progress. For n > 1 only sample 0 is scheduled at first; when its prompt
is prefilled, the others fork from it (see Scheduler.fork).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ..outputs import PositionLogprobs
from ..sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list["Sequence"] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stream: bool = True  # False: outputs only when finished (offline batches)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    grammar_future: object = None  # structured outputs: its grammar, compiling

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # n = 1, the common case: no generator (asked per row per step)
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.status is SequenceStatus.FINISHED for s in seqs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None


class Sequence:
    """One sample of a request: its tokens, progress through them, and KV blocks."""

    def __init__(self, seq_id: int, request: Request, index: int,
                 params: SamplingParams) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.params = params
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Leading entries of block_table freed out of the sliding window (scheduler.HOLE).
        self.num_dropped_blocks = 0
        self.block_hashes: list[int] = []  # prefix-cache identity of each full block
        self.num_cached_tokens: int | None = None  # prompt tokens found in the cache
        self.status = SequenceStatus.WAITING
        self.forks_pending = index == 0 and params.n > 1  # sample 0 spawns the others
        # Its next token is just the argmax of its logits (the decode graph computes that):
        # it needs nothing of the sampler (worker/sampler.py).
        self.plain_greedy = params.plain_greedy
        # Structured outputs: its matcher (engine/grammar.py), set once its grammar is
        # compiled.
        self.grammar = None
        # Output state.
        self.text = ""
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detok_state = None  # owned by the Detokenizer
        self.num_preemptions = 0
        # Speculative decoding: the last num_drafts of token_ids are proposals the coming
        # step verifies (engine/speculative.py); 0 otherwise.
        self.num_drafts = 0
        # Its drafts' acceptance so far and its back-off (speculative.DraftLengthPolicy).
        self.spec_hits = 0.0
        self.spec_tries = 0.0
        self.spec_misses = 0
        self.spec_wait = 0
        # With a draft model (worker/draft_model.py): how many of its tokens the draft's KV
        # cache holds, as of which preemption.
        self.draft_computed = 0
        self.draft_epoch = 0
        self.ngram_index = None  # its n-grams, for n-gram lookup (speculative.NgramIndex)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
