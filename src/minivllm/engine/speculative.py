"""Speculative decoding by n-gram lookup (prompt lookup), greedy and lossless.

Before a step, a running greedy sequence looks for the most recent earlier occurrence of
its last n tokens (n from prompt_lookup_max down to prompt_lookup_min) and proposes the k
tokens that followed it. The proposals are appended to the sequence as draft tokens, so the
scheduler and the model runner see an ordinary chunk of 1 + k tokens; the runner samples
every position of it. After the step the target's greedy token at each position is
compared with the draft there: the drafts up to the first mismatch are accepted and the
target's token at the mismatch (or after the last draft) is added, so the output is token
for token what the target alone would produce. The rejected drafts leave the sequence; the
KV slots they were written to lie past its computed length and are overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sequence import Sequence

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    @classmethod
    def from_dict(cls, cfg: dict | None) -> SpeculativeConfig | None:
        """vLLM's speculative_config dict, validated (ValueError with the reason)."""
        if cfg is None:
            return None
        if not isinstance(cfg, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(cfg).__name__}.")
        unknown = set(cfg) - {"method", "num_speculative_tokens", "prompt_lookup_min",
                              "prompt_lookup_max", "model"}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}.")
        method = cfg.get("method")
        if method == "draft_model" or "model" in cfg:
            raise ValueError("speculative_config: method 'draft_model' is not supported yet; "
                             "use {'method': 'ngram', ...}.")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, "
                             f"got {method!r}.")
        k = cfg.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer "
                             f"in [1, 16], got {k!r}.")
        hi = cfg.get("prompt_lookup_max", 5)
        lo = cfg.get("prompt_lookup_min", min(2, hi) if isinstance(hi, int) else 2)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, "
                                 f"got {v!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) is larger than "
                             f"prompt_lookup_max ({hi}).")
        return cls(method, k, lo, hi)


def ngram_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, for the largest n in [n_min, n_max] that occurs; [] if none does."""
    length = len(tokens)
    if length < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = arr[length - n:]
        # Windows that start before the suffix itself and leave >= 1 token after them.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


def can_speculate(seq: Sequence) -> bool:
    """Greedy sequences without logprobs, at the decode stage (all but the last token in
    the KV cache)."""
    return seq.plain_greedy and seq.num_computed_tokens == len(seq.token_ids) - 1


def accepted_count(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts the target's greedy tokens confirm (targets has one entry
    per draft position plus the one after the last draft)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a
