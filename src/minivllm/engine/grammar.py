"""Structured outputs: grammars from xgrammar, compiled off the engine's path, and one
matcher per sequence that turns its output so far into the next token's mask.

    SamplingParams.structured_outputs -> check_grammar (at the request, a clear error)
    engine.add_request -> GrammarCompiler.submit (a worker thread; memory and disk cache)
    -> the request waits, outside the scheduler, until its grammar is compiled
    -> each step, before the sampler runs: GrammarState.advance (the tokens read since)
       and the row's bitmask filled on the host (BatchGrammarMatcher, C++ threads)
    -> the sampler applies the mask on the device (csrc_triton.sampling, FLAG_GRAMMAR).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import threading
from functools import lru_cache
from pathlib import Path

import torch

from ..config import _env_flag

logger = logging.getLogger(__name__)


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # a dependency, but keep the error readable
        raise ValueError("Structured outputs need the xgrammar package "
                         "(pip install xgrammar).") from e
    return xgrammar


# ---- grammars from the request's constraint ----------------------------------------------

def _choice_ebnf(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _structural_tag_json(value) -> str:
    """vLLM's two shapes: xgrammar's own ({"type": "structural_tag", "format": ...}) and
    the older {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    tag = json.loads(value) if isinstance(value, str) else value
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be a JSON object.")
    if "structures" in tag:
        tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
                 "content": {"type": "json_schema", "json_schema": s.get("schema", {})}}
                for s in tag["structures"]]
        tag = {"type": "structural_tag",
               "format": {"type": "triggered_tags", "triggers": tag.get("triggers", []),
                          "tags": tags}}
    return json.dumps(tag)


def build_grammar(kind: str, value, compact: bool):
    """The xgrammar Grammar of one constraint; ValueError (with xgrammar's reason) when the
    schema, regex or grammar is invalid."""
    xgr = _xgr()
    try:
        if kind == "json":
            schema = value if isinstance(value, str) else json.dumps(value)
            json.loads(schema)  # xgrammar's message for bad JSON is less clear
            return xgr.Grammar.from_json_schema(schema, any_whitespace=not compact)
        if kind == "json_object":  # OpenAI's: an object (any keys), not any JSON value
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                any_whitespace=not compact)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(value))
        if kind == "grammar":
            try:
                return xgr.Grammar.from_ebnf(value)
            except RuntimeError as ebnf_error:
                try:  # vLLM takes Lark grammars too
                    return xgr.Grammar.from_lark(value)
                except Exception:  # noqa: BLE001 - report the EBNF reading's error
                    raise ebnf_error from None
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(_structural_tag_json(value))
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        # xgrammar prefixes its C++ messages with a time and a source position.
        reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason \
            else reason
        raise ValueError(f"Invalid {kind.replace('_', ' ')} for structured outputs: "
                         f"{reason}") from None
    raise ValueError(f"Unknown structured output kind {kind!r}.")


@lru_cache(maxsize=1024)
def _checked(key: tuple[str, str, bool]) -> None:
    kind, text, compact = key
    build_grammar(kind, json.loads(text) if kind == "choice" else text, compact)


def check_grammar(params) -> None:
    """Raise ValueError if a StructuredOutputsParams' constraint does not compile to a
    grammar (cached by its key: a repeated schema costs a lookup)."""
    _checked(params.key())


# ---- compiling, off the engine's path ----------------------------------------------------

# Bump when build_grammar changes what a key compiles to: the disk cache is keyed by it.
_BUILD_VERSION = 2


def _cache_root() -> Path:
    from ..default_model import cache_dir
    return cache_dir() / "grammars"


class GrammarCompiler:
    """Compiles requests' grammars for one tokenizer on a worker thread (xgrammar's
    compiler releases the GIL and uses threads of its own): the engine keeps stepping while
    a new schema compiles. Compiled grammars are kept in memory by key and on disk
    (`<cache>/grammars/<tokenizer digest>/`), so a schema compiles once per machine."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, disk: bool = True) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.disk = disk and _env_flag("MINIVLLM_GRAMMAR_CACHE", True)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "grammar-compile")
        self._futures: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._info = None
        self._compiler = None
        self._dir: Path | None = None
        self.compiled = 0  # grammars compiled here (not from a cache), for the metrics

    def submit(self, params) -> concurrent.futures.Future:
        """A future of the CompiledGrammar for a StructuredOutputsParams."""
        key = params.key()
        with self._lock:
            future = self._futures.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, key, getattr(params, key[0]))
                self._futures[key] = future
        return future

    def _setup(self) -> None:
        """The tokenizer's vocabulary as xgrammar reads it (~1 s for a 50k vocabulary,
        cached on disk like the grammars)."""
        xgr = _xgr()
        vocab = self.tokenizer.get_vocab()
        digest = hashlib.sha256(json.dumps(
            [sorted(vocab.items()), self.vocab_size, self.stop_token_ids,
             type(self.tokenizer).__name__, str(xgr.get_serialization_version())]
        ).encode()).hexdigest()[:24]
        self._dir = _cache_root() / digest
        info_file = self._dir / "tokenizer_info.json"
        info = None
        if self.disk and info_file.is_file():
            try:
                info = xgr.TokenizerInfo.deserialize_json(info_file.read_text())
            except Exception:  # noqa: BLE001 - a stale or broken cache entry: rebuild it
                info = None
        if info is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            if self.disk:
                self._write(info_file, info.serialize_json())
        self._info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))

    @staticmethod
    def _write(path: Path, text: str) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
        except OSError as e:  # a read-only cache is no reason to fail a request
            logger.warning("Could not cache a grammar in %s: %s", path.parent, e)

    def _compile(self, key: tuple, value):
        if self._compiler is None:
            self._setup()
        xgr = _xgr()
        name = hashlib.sha256(json.dumps([_BUILD_VERSION, key]).encode()).hexdigest()[:32]
        name += ".json"
        path = self._dir / name
        if self.disk and path.is_file():
            try:
                return xgr.CompiledGrammar.deserialize_json(path.read_text(), self._info)
            except Exception:  # noqa: BLE001 - recompile
                pass
        kind, _, compact = key
        compiled = self._compiler.compile_grammar(build_grammar(kind, value, compact))
        self.compiled += 1
        if self.disk:
            self._write(path, compiled.serialize_json())
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---- per sequence ------------------------------------------------------------------------

class GrammarState:
    """A sequence's matcher and how many of its output tokens it has accepted. A token the
    grammar refuses (only possible if it was not drawn under the mask) ends the
    constraint for that sequence, with a warning."""

    def __init__(self, compiled) -> None:
        self.matcher = _xgr().GrammarMatcher(compiled)
        self.accepted = 0
        self.broken = False

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not after the grammar's end)."""
        return not self.broken and not self.matcher.is_terminated()

    def advance(self, token_ids: list[int], start: int, end: int,
                last: int | None = None) -> None:
        """Accept the output tokens token_ids[start + accepted:end] (start: where the
        output begins; only the tokens since the last call are read). last: the value of
        token_ids[end - 1] when the list holds a placeholder there (a pipelined step's
        token, read from the device)."""
        first = start + self.accepted
        if self.broken or first >= end:
            return
        matcher = self.matcher
        for at in range(first, end):
            if matcher.is_terminated():
                break
            token = last if last is not None and at == end - 1 else token_ids[at]
            if not matcher.accept_token(token):
                logger.warning("A token (%d) the grammar does not allow reached its matcher; "
                               "this sequence's output is no longer constrained.", token)
                self.broken = True
                break
        self.accepted = end - start

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of drafts (proposed after the accepted tokens) the grammar allows in
        a row; the matcher is left as it was."""
        if not self.active:
            return 0
        n = 0
        for token in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill_after(self, tokens: list[int], bitmask: torch.Tensor, row: int) -> bool:
        """Fill bitmask[row] with what the grammar allows after the accepted tokens and
        then `tokens` (drafts of a speculative step), leaving the matcher as it was.
        False (nothing filled): a token is not allowed, or the grammar ends before."""
        if not self.active:
            return False
        n = self.valid_prefix(tokens)
        if n < len(tokens):
            return False
        for token in tokens:
            self.matcher.accept_token(token)
        filled = not self.matcher.is_terminated()
        if filled:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        if tokens:
            self.matcher.rollback(len(tokens))
        return filled

    def forced_tokens(self, tokenizer, limit: int) -> list[int]:
        """The tokens of the text the grammar forces next (a schema's keys, closing
        braces): drafts the verifier will very likely accept."""
        if not self.active or limit <= 0:
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        return tokenizer.encode(text, add_special_tokens=False)[:limit]


def fill_masks(states: list[GrammarState], bitmask: torch.Tensor) -> None:
    """Rows 0.. of the host bitmask [rows, ceil(vocab / 32)] int32: the tokens each state
    allows next (one row per state, filled on xgrammar's threads)."""
    if len(states) == 1:
        states[0].matcher.fill_next_token_bitmask(bitmask, 0)
        return
    _batch_matcher().batch_fill_next_token_bitmask(
        [s.matcher for s in states], bitmask, list(range(len(states))))


@lru_cache(maxsize=1)
def _batch_matcher():
    return _xgr().BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) - 1)))

