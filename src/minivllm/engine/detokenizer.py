"""Incremental detokenization and stop-string handling.

Text is produced a token at a time by decoding a short window of ids twice (with and
without the newest tokens) and emitting the difference. A window that ends inside a
multi-byte character decodes to U+FFFD; such text is held back until the character is
complete, so no broken character ever reaches a client.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .sequence import Sequence

# Prompt tokens kept as left context so the first output token decodes with its spacing.
_CONTEXT_TOKENS = 5


@dataclass
class _DetokState:
    prefix_offset: int
    read_offset: int


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._window_decode = _fast_decode(tokenizer) or tokenizer.decode
        # One token's text, by (id, skip_special_tokens): logprobs' token texts, and most
        # steps' "prefix" window (the previous step's one new token), decoded once per id.
        self._decode_one = lru_cache(maxsize=1 << 18)(self._decode_single)

    def _decode_single(self, token_id: int, skip_special_tokens: bool = False) -> str:
        return self._window_decode([token_id], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._decode_one(token_id, False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def append_text(self, seq: Sequence) -> str:
        """Decode the sequence's newest token(s); append the new text to seq.text and
        return it ("" while a multi-byte character is incomplete)."""
        if seq.detok_state is None:
            start = seq.num_prompt_tokens
            seq.detok_state = _DetokState(max(0, start - _CONTEXT_TOKENS), start)
        st = seq.detok_state
        ids = seq.token_ids
        skip = seq.params.skip_special_tokens
        decode = self._window_decode
        if st.read_offset - st.prefix_offset == 1:
            prefix = self._decode_one(ids[st.prefix_offset], skip)
        else:
            prefix = decode(ids[st.prefix_offset:st.read_offset], skip_special_tokens=skip)
        full = decode(ids[st.prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        st.prefix_offset = st.read_offset
        st.read_offset = len(ids)
        seq.text += delta
        return delta


def _fast_decode(tokenizer):
    """The Rust tokenizer's own decode, when it gives what tokenizer.decode gives: the
    transformers wrapper around it cost ~4 us of Python per call, and every output token
    takes two calls (at batch 256 that was ~2 ms of host time per step). None when the
    wrapper does more (clean-up of tokenization spaces) or the check below disagrees."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        ids = list(range(min(300, backend.get_vocab_size())))
        special = list(getattr(tokenizer, "all_special_ids", []) or [])[:4]
        for sample in (ids[:40], ids[100:300:7], special + ids[50:60]):
            for skip in (True, False):
                if backend.decode(sample, skip_special_tokens=skip) != tokenizer.decode(
                        sample, skip_special_tokens=skip):
                    return None
    except Exception:  # noqa: BLE001 - any doubt: use the wrapper
        return None
    return backend.decode


def find_stop_string(seq: Sequence, new_text_len: int) -> str | None:
    """Look for a stop string that the newest text completed; on a match, cut seq.text
    (keeping the stop string if asked) and return the stop string."""
    stops = seq.params.stop
    if not stops or new_text_len == 0:
        return None
    text = seq.text
    best_idx, best = None, None
    for stop in stops:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best_idx is None or idx < best_idx):
            best_idx, best = idx, stop
    if best is None:
        return None
    end = best_idx + len(best) if seq.params.include_stop_str_in_output else best_idx
    seq.text = text[:end]
    return best


def visible_text(seq: Sequence) -> str:
    """The text a client may see now: while running, hold back a tail that could still
    turn out to be the start of a stop string."""
    if seq.is_finished or not seq.params.stop:
        return seq.text
    hold = max(len(s) for s in seq.params.stop) - 1
    if hold <= 0:
        return seq.text
    text = seq.text
    # Hold back only as much as actually matches a stop string's beginning.
    for k in range(min(hold, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in seq.params.stop):
            return text[:-k]
    return text
