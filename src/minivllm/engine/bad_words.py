"""bad_words (vLLM's): words the output must not contain, as token sequences.

    engine.add_request -> bad_words_token_ids (each word tokenized as vLLM does)
    -> a one-token word: banned at every step, through the slot's bias row (the sampler's
       FLAG_BIAS, written once)
    -> a longer word: each step, its last token is banned where the output ends with the
       tokens before it (banned_next), through the step's token bitmask (the grammar
       masks' path, FLAG_GRAMMAR).

As vLLM, only the output is matched (not the prompt), and a word is banned both at the
start of the text and after a space.
"""

from __future__ import annotations

import numpy as np


def bad_words_token_ids(tokenizer, words: list[str], vocab: int) -> list[list[int]]:
    """Each word's token ids without and with a leading space; the spaced spelling only
    when it is another token sequence of the same length (vLLM's update_from_tokenizer).
    ValueError for a word that tokenizes outside the vocabulary."""
    out: list[list[int]] = []
    for word in words:
        plain = None
        for spaced in (False, True):
            ids = tokenizer.encode((" " if spaced else "") + word.lstrip(),
                                   add_special_tokens=False)
            if not ids:
                continue
            if not spaced:
                plain = ids
                out.append(ids)
            elif plain is None or (ids[0] != plain[0] and len(ids) == len(plain)):
                out.append(ids)
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"bad_words: {word!r} tokenizes to ids outside the "
                                 f"vocabulary (< {vocab}).")
    return out


def single_token_bans(words: list[list[int]]) -> list[int]:
    """The tokens banned at every step: those of the one-token words."""
    return sorted({w[0] for w in words if len(w) == 1})


def has_sequences(words: list[list[int]]) -> bool:
    """Whether some word needs a per-step check (more than one token)."""
    return any(len(w) > 1 for w in words)


def banned_next(words: list[list[int]], token_ids: list[int], start: int, end: int,
                last: int | None = None) -> list[int]:
    """The last tokens of the multi-token words whose other tokens end the output
    token_ids[start:end] (`last`: the value of token_ids[end - 1] where the list holds a
    placeholder there, a pipelined step's token)."""
    banned = []
    for w in words:
        k = len(w) - 1
        if k == 0 or k > end - start:
            continue
        tail = token_ids[end - k:end]
        if last is not None:
            tail = tail[:-1] + [last]
        if tail == w[:-1]:
            banned.append(w[-1])
    return banned


def ban_in_mask(mask_row, tokens: list[int]) -> None:
    """Clear the tokens' bits in a bitmask row (int32 words, token t at bit t % 32 of
    word t // 32), a CPU tensor or array."""
    words = np.asarray(mask_row).view(np.uint32)
    for t in tokens:
        words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
