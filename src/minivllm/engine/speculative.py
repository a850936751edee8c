"""Speculative decoding by n-gram lookup (prompt lookup), lossless.

Before a step, a running sequence looks for the most recent earlier occurrence of its last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) and proposes the tokens that
followed it, up to its draft length (DraftLengthPolicy). The proposals are appended to the
sequence as draft tokens, so the scheduler and the model runner see an ordinary chunk of
1 + k tokens; the runner samples every position of it as it would without drafts (greedy:
the argmax; sampled: a draw keyed on the request's seed and the position,
worker/sampler.py). After the step the drafts up to the first row whose token differs are
accepted and that row's token (or the one after the last draft) is added: the output is
token for token what the target alone produces, greedy or sampled. The rejected drafts leave the sequence; the
KV slots they were written to lie past its computed length and are overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import Sequence

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft model (method "draft_model")

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
        method = cfg.get("method", "draft_model" if "model" in cfg else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, "
                             f"got {method!r}.")
        k = cfg.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer "
                             f"in [1, 16], got {k!r}.")
        if method == "draft_model":
            lookup = {"prompt_lookup_min", "prompt_lookup_max"} & set(cfg)
            if lookup:
                raise ValueError(f"speculative_config: {sorted(lookup)} apply to method "
                                 "'ngram', not 'draft_model'.")
            model = cfg.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: method 'draft_model' needs 'model', the "
                                 "path of a draft model that shares the target's tokenizer.")
            return cls(method, k, model=model)
        if "model" in cfg:
            raise ValueError("speculative_config: 'model' applies to method 'draft_model'.")
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


class NgramIndex:
    """One sequence's n-grams (n in [n_min, n_max]), each with the position after its
    latest occurrence, extended as the sequence grows: a lookup costs a few dict probes
    instead of a scan of the whole sequence (which took ~0.3 ms for 200 tokens, per
    sequence and step). Keyed by the n-gram's hash, an int, so the index holds no
    containers for the garbage collector to scan; a hit is checked against the tokens."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.after: dict[int, int] = {}
        self.indexed = 0  # n-grams ending at positions <= this are in `after`

    def propose(self, tokens: list[int], k: int, length: int | None = None) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the sequence's
        last n tokens (of its first `length`, default all), for the largest n that occurs;
        [] if none does. The tokens must extend the ones of the previous call (drafts are
        not committed tokens: never pass them)."""
        length = len(tokens) if length is None else length
        after = self.after
        # Index the n-grams that end before the last token (the suffix itself must not
        # find itself).
        for end in range(max(self.indexed + 1, self.n_min), length):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                after[hash(tuple(tokens[end - n:end]))] = end
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            suffix = tokens[length - n:length]
            end = after.get(hash(tuple(suffix)))
            if end is not None and tokens[end - n:end] == suffix:
                return tokens[end:min(end + k, length)]
        return []


def can_speculate(seq: Sequence) -> bool:
    """Sequences at the decode stage (all but the last token in the KV cache). Every draft
    position is sampled as it would be alone: its penalties count the drafts before it
    and its min_tokens bans go by its position (worker/sampler.py), its grammar's mask
    by the drafts before it (engine.LLMEngine._grammar_masks)."""
    return seq.num_computed_tokens == len(seq.token_ids) - 1


class StepCost:
    """A running least-squares fit of a decode step's time as a + b * tokens (recent steps
    weigh most), from which a draft token's share of a step's cost follows."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.w = self.t = self.tt = self.y = self.ty = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.w = d * self.w + 1.0
        self.t = d * self.t + tokens
        self.tt = d * self.tt + tokens * tokens
        self.y = d * self.y + seconds
        self.ty = d * self.ty + tokens * seconds

    def token_share(self, tokens: int) -> float:
        """b * tokens / (a + b * tokens): how much of a step of this many tokens its tokens'
        own cost is (0 while the fit has not seen steps of different sizes)."""
        if self.w < 4:
            return 0.0
        mean_t, mean_y = self.t / self.w, self.y / self.w
        var = self.tt / self.w - mean_t * mean_t
        if var < 0.25:
            return 0.0
        b = max(0.0, (self.ty / self.w - mean_t * mean_y) / var)
        a = max(1e-9, mean_y - b * mean_t)
        return b * tokens / (a + b * tokens)


class BatchGate:
    """Whether speculating pays for the batch as a whole, measured: output tokens per
    second of the steps that looked for drafts (and so ran synchronously) against the steps
    that did not (which a GPU pipelines), per batch size (powers of two). Per-token costs
    miss what a step loses by running synchronously; this does not. Each kind's rate is a
    ratio of decaying sums of tokens and seconds (a step weighs by its length, and a
    pipelined step that yields nothing still counts its time), the looking steps' with a
    short memory: the gate follows the text being written. While speculating loses, the
    batch drafts nothing for a while (16 steps, doubling up to 512 while it keeps losing),
    then tries again; with no plain steps seen yet at a batch size, it pauses to measure
    some."""

    DECAY = (0.95, 0.7)  # per plain step, per looking step
    FIRST_PAUSE, MAX_PAUSE, PROBE = 16, 512, 4

    def __init__(self) -> None:
        # batch bucket -> [[plain tokens, seconds], [looking tokens, seconds], looking steps]
        self.sums: dict[int, list] = {}
        self.pause = 0
        self.pause_len = self.FIRST_PAUSE

    def open(self) -> bool:
        return self.pause == 0

    @staticmethod
    def _bucket(num_seqs: int) -> int:
        return 1 << (num_seqs - 1).bit_length()

    def rates(self, num_seqs: int) -> tuple[float | None, float | None]:
        """(plain, looking) tok/s measured at this batch size (None: not measured)."""
        entry = self.sums.get(self._bucket(num_seqs))
        return (None, None) if entry is None else self._rates(entry)

    @staticmethod
    def _rates(entry: list) -> tuple[float | None, float | None]:
        return tuple(t / s if s > 0 else None for t, s in entry[:2])

    def record(self, num_seqs: int, tokens: int, seconds: float, drafted: bool) -> None:
        """One step: its batch size, the tokens it added, its wall time and whether it
        looked for drafts."""
        if self.pause:
            self.pause -= 1
        if num_seqs == 0 or seconds <= 0:
            return
        entry = self.sums.setdefault(self._bucket(num_seqs), [[0.0, 0.0], [0.0, 0.0], 0])
        sums, d = entry[drafted], self.DECAY[drafted]
        sums[0] = d * sums[0] + tokens
        sums[1] = d * sums[1] + seconds
        if not drafted:
            return
        entry[2] += 1
        plain, spec = self._rates(entry)
        if plain is None:
            if entry[2] % self.PROBE == 0:
                self.pause = self.PROBE  # measure plain steps at this batch size
        elif spec < plain:
            self.pause, self.pause_len = self.pause_len, min(2 * self.pause_len, self.MAX_PAUSE)
        else:
            self.pause_len = self.FIRST_PAUSE


class DraftLengthPolicy:
    """How many drafts a sequence proposes: as many as pay for their verification.

    Each sequence keeps an estimate alpha of the chance that its next draft is accepted
    (accepted drafts over accepted + rejected, recent verifications weighing most, from a
    prior of 0.6). The i-th draft of a step is then accepted with probability ~alpha^i; it
    is worth its cost if alpha^i is at least the share of the step's time that one more
    token costs, times the tokens the step yields without drafts (StepCost): on a GPU,
    where a few more tokens cost almost nothing, nearly every draft pays; on a CPU, where
    each token costs, only well-predicted text drafts. A sequence that does not draft lets
    its estimate drift back to the prior, so it tries again later. After a verification
    that accepted nothing a sequence also waits 1, 3, 7, then 15 steps before drafting
    again, after a lookup that found nothing one step; steps in which no sequence is due
    to draft are pipelined like plain decoding.

    Above the sequences, a BatchGate stops all drafting while drafted steps yield fewer
    tokens per second than plain ones.

    Which steps draft never changes a sampled request's tokens: the target draws each
    position with that position's own random numbers (worker/sampler.py)."""

    PRIOR, PRIOR_WEIGHT, DECAY, DRIFT = 0.6, 2.0, 0.9, 0.97

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.cost = StepCost()
        self.gate = BatchGate()

    @classmethod
    def acceptance(cls, seq: Sequence) -> float:
        return (seq.spec_hits + cls.PRIOR * cls.PRIOR_WEIGHT) / (seq.spec_tries
                                                                 + cls.PRIOR_WEIGHT)

    def threshold(self, num_running: int) -> float | None:
        """The step's bar for alpha^i with num_running sequences in the batch (None: the
        gate is closed); computed once per step."""
        return self.cost.token_share(num_running) if self.gate.open() else None

    def draft_length(self, seq: Sequence, threshold: float | None) -> int:
        """How many drafts seq proposes this step (0: none), given the step's threshold."""
        if seq.spec_wait or threshold is None:
            return 0
        alpha, length, gain = self.acceptance(seq), 0, 1.0
        while length < self.k:
            gain *= alpha
            if gain < threshold:
                break
            length += 1
        return length

    def idle(self, seq: Sequence) -> None:
        """A step in which seq proposes nothing: its wait runs down, or its estimate drifts
        back towards the prior."""
        if seq.spec_wait:
            seq.spec_wait -= 1
        else:
            seq.spec_hits *= self.DRIFT
            seq.spec_tries *= self.DRIFT

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        seq.spec_hits = self.DECAY * seq.spec_hits + accepted
        seq.spec_tries = self.DECAY * seq.spec_tries + accepted + (accepted < proposed)
        if accepted:
            seq.spec_misses = seq.spec_wait = 0
        else:  # wait 1, 3, 7, then 15 steps before the next try
            seq.spec_misses = min(seq.spec_misses + 1, 4)
            seq.spec_wait = (1 << seq.spec_misses) - 1

    @staticmethod
    def nothing_found(seq: Sequence) -> None:
        """No n-gram match: look again after one step (a lookup is cheap; the steps it
        keeps from being pipelined count against speculation in the BatchGate)."""
        seq.spec_wait = 1


def accepted_count(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts the target's tokens confirm (targets has one entry per
    draft position plus the one after the last draft)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a
