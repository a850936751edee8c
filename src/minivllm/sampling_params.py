"""SamplingParams: how one request is decoded, validated up front with clear errors."""

from __future__ import annotations

import copy
import enum
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what a request's outputs hold as it runs (cumulative text, the newest piece,
    or the final output only). Offline generate() returns final outputs whatever the
    kind; accepted so vLLM code runs."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, as vLLM's: exactly one of a JSON schema (`json`, a dict
    or its JSON text), any JSON object (`json_object`), a regular expression (`regex`), one
    of some strings (`choice`), an EBNF (or Lark) grammar (`grammar`) or an xgrammar
    structural tag (`structural_tag`, its JSON). Enforced on the device by the sampler,
    through a token mask from xgrammar (engine/grammar.py). disable_any_whitespace: JSON
    without whitespace between its tokens (small models otherwise may loop on it).
    disable_additional_properties: accepted either way, since xgrammar compiles schemas in
    strict mode, which already refuses properties a schema does not name (as vLLM with
    xgrammar). whitespace_pattern: xgrammar has none (vLLM's xgrammar backend refuses it
    too), so only None."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (xgrammar "
                             "has no whitespace pattern); use disable_any_whitespace=True for "
                             "JSON without whitespace.")
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, "
                             f"grammar, json_object, structural_tag; got {given or 'none'}.")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        from .engine.grammar import check_grammar
        check_grammar(self)  # a clear ValueError for an invalid schema, regex or grammar

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, its canonical text, whitespace)."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            import json as _json
            value = _json.dumps(value, sort_keys=True, separators=(",", ":"))
        return self.kind, str(value), self.disable_any_whitespace


@dataclass
class SamplingParams:
    """Decoding parameters, named and bounded as in vLLM.

    temperature 0 means greedy. top_k 0 or -1 disables top-k. seed makes a request's
    sampled tokens reproducible whatever else shares its batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    structured_outputs: StructuredOutputsParams | None = None
    # False: no text, only token ids (stop strings then cannot match: refused).
    detokenize: bool = True
    allowed_token_ids: list[int] | None = None  # only these may be drawn
    # Words the output must not contain (vLLM's rule: engine/bad_words.py).
    bad_words: list[str] | None = None
    # Keep only the prompt's last k tokens (-1: max_model_len), before validation.
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None  # kept for the caller; read by nothing here
    # vLLM's older fields, accepted at the values that ask for nothing.
    best_of: int | None = None
    logits_processors: Any = None
    guided_decoding: Any = None
    # Filled in by the engine from the tokenizer / generation config.
    _eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)
    # bad_words as token sequences, both spellings (bad_words.bad_words_token_ids).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None  # vLLM's "no seed"
        if self.logit_bias:
            try:
                self.logit_bias = {int(t): b for t, b in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias keys must be token ids.") from None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, bool) \
                and self.output_kind in set(RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}.")
        if self.temperature is None or self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if (not isinstance(self.repetition_penalty, (int, float))
                or not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0):
            bad(f"repetition_penalty must be a finite number > 0, got "
                f"{self.repetition_penalty!r}.")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or isinstance(self.seed, bool)):
            bad(f"seed must be an integer (-1 or None: no seed), got {self.seed!r}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens}).")
        for name in ("logprobs", "prompt_logprobs"):
            # The most allowed is the engine's max_logprobs (LLMEngine.validate_prompt).
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < -1):
                bad(f"{name} must be an integer >= 0, or -1 for the whole vocabulary, "
                    f"got {value!r}.")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                bad("stop strings must be non-empty strings.")
        if not isinstance(self.detokenize, bool):
            bad(f"detokenize must be True or False, got {self.detokenize!r}.")
        if self.stop and not self.detokenize:
            bad("stop strings need the text: they are not supported with detokenize=False "
                "(use stop_token_ids).")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids is empty: give at least one token id, or None.")
            for t in self.allowed_token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    bad(f"allowed_token_ids must be token ids (integers >= 0), got {t!r}.")
        for w in self.bad_words or []:
            if not isinstance(w, str) or not w.strip():
                bad(f"bad_words must be non-empty strings, got {w!r}.")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k == 0
                              or k < -1):
            bad(f"truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len), "
                f"got {k!r}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                f"got {self.output_kind!r}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            bad(f"extra_args must be a dict, got {type(self.extra_args).__name__}.")
        if self.best_of is not None and self.best_of != self.n:
            bad(f"best_of is not supported (other than best_of == n), got best_of="
                f"{self.best_of!r} with n={self.n}.")
        if self.logits_processors:
            bad("logits_processors are not supported: constrain the output with "
                "structured_outputs=StructuredOutputsParams(...), or steer tokens with "
                "logit_bias, allowed_token_ids or bad_words.")
        if self.guided_decoding is not None:
            bad("guided_decoding is not supported: pass the same constraint as "
                "structured_outputs=StructuredOutputsParams(json=..., regex=..., choice=..., "
                "grammar=...).")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                bad(f"stop_token_ids must be non-negative integers, got {t!r}.")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                bad(f"logit_bias keys must be token ids, got {t!r}.")
            if not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                bad(f"logit_bias values must be in [-100, 100], got {b!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def plain_greedy(self) -> bool:
        """Whether a token is just the argmax of the logits: nothing of the sampler."""
        return (self.greedy and self.logprobs is None and not self.logit_bias
                and not self.has_penalties and self.min_tokens == 0
                and self.structured_outputs is None and self.allowed_token_ids is None
                and not self.bad_words)

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the earlier tokens' values (not only the logits)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


def fit_default_max_tokens(params: SamplingParams, room: int) -> SamplingParams:
    """`params` whose max_tokens is a default, not the caller's (generation_config.json's
    max_new_tokens, the CLI's 256), cut to the `room` a prompt leaves in the context
    (vLLM's get_max_tokens). Left as it is where even min_tokens would not fit, so that
    validation says why."""
    if params.max_tokens is not None and max(1, params.min_tokens) <= room < params.max_tokens:
        params = params.clone()
        params.max_tokens = room
    return params


# ---- generation_config.json defaults (vLLM's --generation-config) -------------------------

# The generation_config.json keys taken as sampling defaults, and their SamplingParams
# names: vLLM's list. Others (do_sample, num_beams, eos_token_id, ...) are ignored.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}
GENERATION_CONFIG_FILE = "generation_config.json"


def generation_config_defaults(generation_config: str | os.PathLike | None,
                               model_path: str | os.PathLike | None) -> dict:
    """The sampling defaults that `generation_config` gives, as SamplingParams keyword
    arguments (max_new_tokens becomes max_tokens), for the fields a request leaves unset.

    "auto" (or None): the model folder's generation_config.json (for a .gguf, the folder
    holding it); no file, no defaults. "vllm": none (OpenAI's defaults: temperature 1.0 ...).
    Any other value: a folder whose generation_config.json is read (it must exist).
    Only the keys of GENERATION_CONFIG_FIELDS with non-null values count. A file that is not
    valid JSON, or whose values SamplingParams refuses, raises ValueError (naming the file):
    a server should not start with defaults other than the ones its model asks for."""
    choice = "auto" if generation_config is None else str(generation_config)
    if choice == "vllm":
        return {}
    if choice == "auto":
        if model_path is None:
            return {}
        folder = Path(model_path)
        if not folder.is_dir():  # a .gguf or config.json: its folder
            folder = folder.parent
        path = folder / GENERATION_CONFIG_FILE
        if not path.is_file():
            return {}
    else:
        folder = Path(choice).expanduser()
        if not folder.is_dir():
            raise ValueError(f"generation_config {choice!r} is not 'auto', 'vllm' or a "
                             "folder holding generation_config.json.")
        path = folder / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise ValueError(f"There is no {GENERATION_CONFIG_FILE} in {str(folder)!r} "
                             "(generation_config).")
    hint = "fix it, or pass generation_config='vllm' (--generation-config vllm) to ignore it"
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON file ({e}): {hint}.") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(raw).__name__}: "
                         f"{hint}.")
    defaults = {ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items()
                if raw.get(theirs) is not None}
    for name, value in defaults.items():
        integer = name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(
                value, int if integer else (int, float)) or not math.isfinite(value):
            key = "max_new_tokens" if name == "max_tokens" else name
            raise ValueError(f"{path}: {key} must be {'an integer' if integer else 'a number'}"
                             f", got {value!r}: {hint}.")
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path} has sampling defaults SamplingParams refuses ({e}): "
                         f"{hint}.") from None
    if defaults:
        logger.info("Sampling defaults from %s, for the fields a request "
                    "leaves unset: %s (generation_config='vllm', --generation-config vllm, "
                    "ignores them)", path, ", ".join(f"{k}={v!r}" for k, v in defaults.items()))
    return defaults
