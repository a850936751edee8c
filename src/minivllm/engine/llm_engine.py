"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> _process (append tokens,
    fork samples, detokenize, stop checks, free finished) -> RequestOutputs
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import numbers
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC


from ..config import (EngineConfig, ModelConfig, attention_backend, load_config_json,
                      pipelining_enabled, resolve_device, resolve_dtype, resolve_model_path)
from ..model.loader import weight_bytes
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams, fit_default_max_tokens
from ..tokenizer import load_tokenizer
from ..worker.draft_model import DraftModel
from ..worker.kv_cache import block_bytes
from ..worker.model_runner import ModelRunner, PendingDecode, StepResult
from ..worker.sampler import SamplerOutput
from .bad_words import ban_in_mask, banned_next, bad_words_token_ids, has_sequences
from .detokenizer import Detokenizer, find_stop_string, visible_text
from .grammar import GrammarCompiler, GrammarState, fill_masks
from .scheduler import ScheduledBatch, Scheduler
from .speculative import (DraftLengthPolicy, NgramIndex, SpeculativeConfig, accepted_count,
                          can_speculate)
from .sequence import Request, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

# Stands for a token sampled on the device but not yet read back (pipelined decoding).
PLACEHOLDER_TOKEN = -1
STEP_HISTORY = 240  # steps kept in LLMEngine.step_history


def recent_steps(engine: "LLMEngine") -> list[tuple]:
    """The engine's last steps (an AsyncLLMEngine.call function: module-level, so it
    crosses to an engine process)."""
    return list(engine.step_history)


def needs_masks(params: SamplingParams) -> bool:
    """Whether a request's rows may carry a token bitmask: a grammar, or bad_words of more
    than one token (their bans depend on the output so far)."""
    return params.structured_outputs is not None or has_sequences(params._bad_words_token_ids)


def as_token_ids(ids) -> list[int]:
    """A prompt's token ids as a list of Python ints: numpy integers (an array's items)
    become ints; anything else is left for validate_prompt to name."""
    out = list(ids)
    for i, t in enumerate(out):
        if not isinstance(t, (int, bool)) and isinstance(t, numbers.Integral):
            out[i] = int(t)
    return out


def read_model_config(model) -> tuple:
    """(weights path, config path, ModelConfig) of a model folder, config.json or GGUF file
    (a GGUF file is both)."""
    model_path, config_path = resolve_model_path(model)
    if model_path.suffix == ".gguf" or config_path.suffix == ".gguf":
        from ..model.gguf_loader import load_gguf_state
        model_path = config_path
        raw_cfg, _ = load_gguf_state(config_path)
    else:
        raw_cfg = load_config_json(config_path)
    return model_path, config_path, ModelConfig.from_dict(raw_cfg)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner_factory: Callable | None = None) -> None:
        """runner_factory(config, model_config, device): a stand-in for the ModelRunner
        (engine/simulate.py's, which schedules without a model)."""
        start = time.perf_counter()
        self.config = config
        model_path, config_path, self.model_config = read_model_config(config.model)
        self.model_path = model_path
        self.device = resolve_device(config.device)
        config.finalize(self.model_config, self.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.checkpoint_dtype, self.device)

        self.tokenizer = None
        self.detokenizer = None
        if not config.skip_tokenizer_init:
            tok_source = config.tokenizer or (model_path if model_path.is_dir() else config_path)
            self.tokenizer = load_tokenizer(tok_source)
            self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids or (
            [self.tokenizer.eos_token_id] if self.tokenizer is not None
            and self.tokenizer.eos_token_id is not None else []))

        backend = attention_backend(self.device)
        self.speculative = SpeculativeConfig.from_dict(config.speculative_config)
        draft = None
        if self.speculative is not None and self.speculative.method == "draft_model":
            draft = self._draft_model_config()
        # A draft model's weights and KV cache (as many blocks) come out of the KV budget.
        reserved = (0, 0) if draft is None else (
            weight_bytes(draft[1], self.dtype), block_bytes(draft[1], config.block_size,
                                                            config.kv_dtype(self.dtype)))
        if runner_factory is not None:
            self.runner = runner_factory(config, self.model_config, self.device)
        else:
            self.runner = ModelRunner(config, self.model_config, model_path, self.device,
                                      self.dtype, backend, reserved)
        self.drafter = None
        if draft is not None:
            # The target's quantization at load applies to the draft too; a checkpoint's own
            # (GPTQ, AWQ, ...) is each model's, read from its config.
            from ..model.quantization import METHODS
            ahead = bool((draft[1].raw or {}).get("quantization_config"))
            draft_cfg = dataclasses.replace(
                config, model=self.speculative.model, tokenizer=None, speculative_config=None,
                num_kv_blocks=self.runner.num_blocks, tensor_parallel_size=1,
                quantization=(config.quantization
                              if config.quantization in METHODS and not ahead else None))
            self.drafter = DraftModel(ModelRunner(draft_cfg, draft[1], draft[0], self.device,
                                                  self.dtype, backend, proposals=True))
        if self.runner.num_blocks * config.block_size < config.max_model_len:
            raise ValueError(
                f"The KV cache holds {self.runner.num_blocks * config.block_size} tokens, less "
                f"than max_model_len={config.max_model_len}: lower max_model_len or give the "
                "cache more memory.")
        parts = ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {secs:.1f}s"
                          for name, secs in self.runner.startup.items())
        logger.info("Engine ready in %.1fs (%s); model %.2f GB%s; KV cache: %d blocks, %d "
                    "tokens.", time.perf_counter() - start, parts,
                    self.runner.weight_bytes() / 1e9, self.runner.quantization_label(),
                    self.runner.num_blocks, self.runner.num_blocks * config.block_size)
        self.scheduler = Scheduler(
            num_blocks=self.runner.num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            sliding_window=self._freeable_window(draft))
        self.requests: dict[str, Request] = {}
        # Steps launched before the previous one is read back (decode steps, and mixed
        # steps of new requests joining in-flight decodes).
        self._pipelined = pipelining_enabled()
        self._draft_secs = 0.0
        self._looked_for_drafts = False  # in this step (BatchGate)
        if self.speculative is not None:
            self.draft_policy = DraftLengthPolicy(self.speculative.num_speculative_tokens)
        self._pending: PendingDecode | None = None
        self._ranks_out_of_step: BaseException | None = None  # see _step
        self.step_history: collections.deque = collections.deque(maxlen=STEP_HISTORY)
        # Structured outputs: requests wait here (not in the scheduler) for their grammar.
        self.grammars: GrammarCompiler | None = None
        self._awaiting_grammar: list[Request] = []
        # Requests with a grammar or multi-token bad_words: the hooks below return at once
        # without any.
        self._num_constrained = 0
        self.runner.sampler.before_sample = self._grammar_masks
        if self.drafter is not None:
            self.drafter.runner.sampler.before_sample = self._grammar_masks
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0,
                      "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                      "spec_decode_num_accepted_tokens": 0}

    def _freeable_window(self, draft) -> int | None:
        """The window within which every layer attends, when blocks before it can go back
        to the pool: shorter than max_model_len, and no draft model (which shares the
        block tables and may attend to everything)."""
        window = self.model_config.kv_window
        if window is None or window >= self.config.max_model_len or draft is not None:
            return None
        return window

    def _draft_model_config(self) -> tuple:
        """(weights path, ModelConfig) of the draft model, checked against the target."""
        path, _, cfg = read_model_config(self.speculative.model)
        if cfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary ({cfg.vocab_size} tokens) "
                f"is not the target's ({self.model_config.vocab_size}); a draft model must "
                "share the target's tokenizer.")
        return path, cfg

    # ---- requests ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def new_request_id(self) -> str:
        return str(next(self._request_ids))

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("This engine has no tokenizer (skip_tokenizer_init=True): "
                             "pass prompt token ids instead of text.")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def validate_prompt(self, token_ids: SequenceABC[int], params: SamplingParams,
                        fill_context: bool = False) -> None:
        """ValueError for a prompt or params this engine cannot run. The server's rule
        (fill_context False): the prompt and max_tokens must fit the context together.
        vLLM's offline rule (fill_context True): only a prompt longer than the context is
        refused; the output stops with "length" once the context is full."""
        if len(token_ids) == 0:
            raise ValueError("The prompt is empty: give at least one token.")
        vocab = self.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"Token id {t!r} is out of vocabulary (valid: 0..{vocab - 1}).")
        limit = self.max_model_len
        if fill_context:
            # vLLM's check is len > max_model_len: a prompt that fills the context exactly
            # still samples one token (from its last position's logits), then "length".
            if len(token_ids) > limit:
                raise ValueError(
                    f"The prompt has {len(token_ids)} tokens, longer than this model's "
                    f"maximum context length of {limit} tokens (max_model_len).")
        elif len(token_ids) >= limit:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens, but this model's maximum context "
                f"length is {limit} tokens and at least one must be left for the output.")
        elif params.max_tokens is not None and len(token_ids) + params.max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(token_ids) + params.max_tokens} tokens ({len(token_ids)} in "
                f"the prompt, {params.max_tokens} for the completion). Please reduce the "
                "prompt or max_tokens.")
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids has {t}, outside the vocabulary (< {vocab}).")
        for t in params.logit_bias or {}:
            if t >= vocab:
                raise ValueError(f"logit_bias has token {t}, outside the vocabulary (< {vocab}).")
        for t in params.allowed_token_ids or []:
            if t >= vocab:
                raise ValueError(f"allowed_token_ids has token {t}, outside the vocabulary "
                                 f"(< {vocab}).")
        cap = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and (vocab if value == -1 else value) > (
                    vocab if cap == -1 else cap):
                raise ValueError(
                    f"{name}={value} asks for more logprobs than this engine's max_logprobs "
                    f"({cap}) allows; raise max_logprobs (-1: the whole vocabulary).")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need the tokenizer (this engine has "
                             "skip_tokenizer_init=True).")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} is more samples than this engine runs at once "
                             f"(max_num_seqs={self.config.max_num_seqs}).")

    def add_request(self, prompt: str | list[int] | dict | None, params: SamplingParams,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, stream: bool = True,
                    default_max_tokens: bool = False, fill_context: bool = False) -> str:
        """Queue a request. stream=False reports it only once it has finished, which
        saves building an output per step for offline batches. default_max_tokens: the
        params' max_tokens is a default (generation_config.json's max_new_tokens, the CLI's
        256), not the caller's: fit_default_max_tokens cuts it to the room the prompt
        leaves, as the server does, rather than refusing it. fill_context: vLLM's offline
        rule (see validate_prompt), for LLM.generate."""
        if isinstance(prompt, dict):
            prompt_token_ids = prompt.get("prompt_token_ids")
            prompt = prompt.get("prompt")
        if isinstance(prompt, (list, tuple)):
            prompt_token_ids, prompt = list(prompt), None
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("A prompt must be a string, a list of token ids, or a dict "
                                 "with 'prompt_token_ids'.")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = as_token_ids(prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            prompt_token_ids = self._truncate(prompt_token_ids, params.truncate_prompt_tokens)
        if default_max_tokens:
            params = fit_default_max_tokens(params, self.max_model_len - len(prompt_token_ids))
        params = params.clone()
        params._eos_token_ids = self.eos_token_ids
        self.validate_prompt(prompt_token_ids, params, fill_context)
        if params.max_tokens is None:
            # At least one: a prompt that fills the context samples one token (vLLM's).
            params.max_tokens = max(1, self.max_model_len - len(prompt_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None:  # -1: the whole vocabulary
                setattr(params, name, self.vocab_size if value == -1
                        else min(value, self.vocab_size))
        if params.bad_words:
            params._bad_words_token_ids = bad_words_token_ids(
                self.tokenizer, params.bad_words, self.vocab_size)
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        req = Request(request_id, prompt, prompt_token_ids, params, stream=stream)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        for i in range(params.n):
            child = params if params.n == 1 else params.clone()
            if params.n > 1 and params.seed is not None:
                child.seed = params.seed + i  # distinct but reproducible samples
            req.seqs.append(Sequence(next(self._seq_ids), req, i, child))
        if needs_masks(params):
            self._num_constrained += 1
        if params.structured_outputs is not None:
            req.grammar_future = self._grammar_compiler().submit(params.structured_outputs)
            self._awaiting_grammar.append(req)
        else:
            self.scheduler.add(req.seqs[0])
        self.requests[request_id] = req
        self.stats["prompt_tokens"] += len(prompt_token_ids)
        return request_id

    def _truncate(self, token_ids: list[int], keep: int) -> list[int]:
        """The prompt's last `keep` tokens (truncate_prompt_tokens; -1: max_model_len)."""
        limit = self.max_model_len
        if keep > limit:
            raise ValueError(f"truncate_prompt_tokens ({keep}) is more than max_model_len "
                             f"({limit}): choose a smaller one, or -1 for max_model_len.")
        keep = limit if keep == -1 else keep
        return token_ids[-keep:] if len(token_ids) > keep else token_ids

    # ---- structured outputs (engine/grammar.py) ----------------------------------------

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise ValueError("Structured outputs need the tokenizer (this engine has "
                             "skip_tokenizer_init=True).")
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size,
                                            self.eos_token_ids)
        return self.grammars

    def _admit_compiled(self) -> list[Request]:
        """Hand the requests whose grammar is ready to the scheduler; returns those whose
        grammar failed to compile (finished, "abort")."""
        waiting, failed = [], []
        for req in self._awaiting_grammar:
            if req.request_id not in self.requests:
                continue  # aborted while it waited
            if not req.grammar_future.done():
                waiting.append(req)
                continue
            try:
                compiled = req.grammar_future.result()
            except Exception:  # noqa: BLE001 - the request fails, the engine goes on
                logger.exception("Request %s: its grammar failed to compile",
                                 req.request_id)
                for seq in req.seqs:
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                req.finished_time = time.monotonic()
                self._forget(req.request_id)
                failed.append(req)
                continue
            for seq in req.seqs:
                seq.grammar = GrammarState(compiled)
            req.grammar_future = None
            self.scheduler.add(req.seqs[0])
        self._awaiting_grammar = waiting
        return failed

    def _grammar_masks(self, sampler, seqs, positions: list[int]) -> dict[int, int] | None:
        """The samplers' hook, first thing in a step's sampling (on a pipelined step after
        its model graph is launched, so this overlaps it): each constrained row's matcher
        takes the tokens read since (the pending step's, read here), and the rows it
        still constrains get their bitmask. A row after drafts (speculative decoding, or
        the draft model's own steps) is masked as if they were accepted. A row whose
        output ends with all but the last token of a bad word has that token cleared from
        its mask (a mask of every token if it has no grammar). Returns row -> mask row."""
        if not self._num_constrained:
            return None
        rows = [i for i, s in enumerate(seqs)
                if s.grammar is not None or s.params._bad_words_token_ids]
        if not rows:
            return None
        pending = None
        plain, after_drafts, bans = [], [], []
        for i in rows:
            seq = seqs[i]
            start, end = seq.num_prompt_tokens, positions[i]
            last = None
            if end == len(seq.token_ids) and seq.token_ids[-1] == PLACEHOLDER_TOKEN:
                if pending is None:
                    pending = self._pending.tokens_by_seq()
                last = pending[seq.seq_id]
            words = seq.params._bad_words_token_ids
            if words:
                banned = banned_next(words, seq.token_ids, start, end, last)
                if banned:
                    bans.append((i, banned))
            g = seq.grammar
            if g is None:
                continue
            committed = len(seq.token_ids) - seq.num_drafts
            g.advance(seq.token_ids, start, min(end, committed), last)
            if end > committed:
                after_drafts.append((i, seq.token_ids[committed:end]))
            elif g.active:
                plain.append(i)
        buffer = sampler.mask_buffer()
        masks = {i: m for m, i in enumerate(plain)}
        if plain:
            fill_masks([seqs[i].grammar for i in plain], buffer)
        for i, drafts in after_drafts:
            if seqs[i].grammar.fill_after(drafts, buffer, len(masks)):
                masks[i] = len(masks)
        for i, banned in bans:
            if i not in masks:
                masks[i] = len(masks)
                buffer[masks[i]].fill_(-1)  # every token, then the bans
            ban_in_mask(buffer[masks[i]].numpy(), banned)
        return masks

    def _clip_drafts(self, batch: ScheduledBatch) -> None:
        """Constrained sequences' drafts end where their grammar stops allowing them (a
        draft model proposes under the masks too; n-gram drafts may not fit)."""
        if not self._num_constrained:
            return
        for i, seq in enumerate(batch.seqs):
            k = seq.num_drafts
            if not k or seq.grammar is None:
                continue
            keep = seq.grammar.valid_prefix(seq.token_ids[len(seq.token_ids) - k:])
            if keep < k:
                del seq.token_ids[len(seq.token_ids) - (k - keep):]
                seq.num_drafts = keep
                seq.draft_computed = min(seq.draft_computed, len(seq.token_ids))
                batch.num_new_tokens[i] -= k - keep

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and return its blocks. Unknown or finished ids are ignored."""
        req = self._forget(request_id)
        if req is None:
            return False
        for seq in req.seqs:
            if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER_TOKEN:
                seq.token_ids.pop()  # its pending token will be dropped
            if not seq.is_finished:
                self.scheduler.finish(seq)
                self._release(seq)
                seq.finish_reason = seq.finish_reason or "abort"
        return True

    def _release(self, seq: Sequence) -> None:
        """A sequence left the running ones (finished, aborted, preempted): its sampling
        slot goes back (a preempted one takes a new slot when it samples again)."""
        self.runner.sampler.release(seq)
        if self.drafter is not None:
            self.drafter.runner.sampler.release(seq)

    def _forget(self, request_id: str) -> Request | None:
        """Take a request out of the live ones (finished, aborted, failed)."""
        req = self.requests.pop(request_id, None)
        if req is not None and needs_masks(req.params):
            self._num_constrained -= 1
        return req

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks (LLM.reset_prefix_cache); True once done."""
        self.scheduler.pool.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step can make progress: scheduled work, a step in flight, or
        requests whose grammar is compiling."""
        return (self.scheduler.has_work() or self._pending is not None
                or bool(self._awaiting_grammar))

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step. Runs of greedy decode steps are pipelined: step N+1 is
        launched on the device before step N's tokens are read back, so the host's
        bookkeeping overlaps the device's work (see `_step_pipelined`)."""
        return self._step(self._outputs)

    def step_requests(self) -> list[Request]:
        """One step like `step`, returning the requests it would report (each once)
        instead of their RequestOutputs: for an owner that sends only what changed
        (the engine process, output_codec.OutputEncoder), building a cumulative output
        per request per step is wasted host time. Read them before the next step."""
        seen: dict[str, Request] = {}
        for req in self._step(self._reportable):
            seen.setdefault(req.request_id, req)
        return list(seen.values())

    def _step(self, report: Callable[[list[Request]], list]) -> list:
        if self._ranks_out_of_step is not None:
            raise RuntimeError("A tensor-parallel step failed or was interrupted, so the "
                               "ranks may be out of step: this engine takes no more steps. "
                               "Start a new one.") from self._ranks_out_of_step
        start = time.perf_counter()
        try:
            if self.speculative is None:
                out = self._plan_and_run(report)
            else:
                tokens = self.stats["generation_tokens"]
                self._looked_for_drafts = False
                out = self._plan_and_run(report)
                self.draft_policy.gate.record(
                    len(self.scheduler.running), self.stats["generation_tokens"] - tokens,
                    time.perf_counter() - start, self._looked_for_drafts)
        except BaseException as e:
            if self.runner.tp is not None:
                # Its collectives may have stopped between two of the workers': another
                # step would wait for them forever.
                self._ranks_out_of_step = e
            raise
        # The last steps, for the dashboard's timeline: when, what (the runner's path,
        # tokens, sequences), how long the host spent in it.
        self.step_history.append((time.monotonic(), *(self.runner.last_step or ("idle", 0, 0)),
                                  time.perf_counter() - start))
        return out

    def _plan_and_run(self, report: Callable[[list[Request]], list]) -> list:
        if self._awaiting_grammar:
            failed = self._admit_compiled()
            if failed:
                return report(failed)
        if self._pending is not None and not self._pipeline_can_continue():
            touched = self._resolve_pending()
            return report(touched) + report(self._step_sync())
        batch = self._schedule()
        if not batch.seqs:
            touched = self._resolve_pending() if self._pending is not None else []
            if not touched and self.scheduler.has_work():
                raise RuntimeError("The scheduler could not schedule any work; the KV cache "
                                   "is too small for the waiting requests.")
            if not touched and self._awaiting_grammar:
                # Nothing runs but grammars compile: wait for one instead of spinning.
                concurrent.futures.wait(
                    [r.grammar_future for r in self._awaiting_grammar], timeout=0.01,
                    return_when=concurrent.futures.FIRST_COMPLETED)
            return report(touched)
        self._mark_scheduled(batch)
        # With a step pending, _pipeline_can_continue() already vetted every running
        # sequence and every request this schedule could admit; the batch holds only those.
        if self._pipelined and self.runner.can_launch_async(batch) and (
                self._pending is not None or self._batch_can_pipeline(batch)):
            return self._step_pipelined(batch, report)
        touched = []
        if self._pending is not None:
            # A batch that cannot be launched ahead (e.g. a mixed step past the largest
            # graph bucket): read the pending step, then drop the sequences that it
            # finished from this batch.
            touched = self._resolve_pending()
            keep = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
            batch.seqs = [batch.seqs[i] for i in keep]
            batch.num_new_tokens = [batch.num_new_tokens[i] for i in keep]
            if not batch.seqs:
                return report(touched)
        return report(touched) + report(self._run_sync(batch))

    def _reportable(self, touched: list[Request]) -> list[Request]:
        return [req for req in touched if req.stream or req.finished_time is not None]

    def _outputs(self, touched: list[Request]) -> list[RequestOutput]:
        return [self.make_output(req) for req in self._reportable(touched)]

    def _mark_scheduled(self, batch: ScheduledBatch) -> None:
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now

    def _schedule(self) -> ScheduledBatch:
        """The scheduler's next batch. With speculation, drafts are proposed before it (only
        for sequences whose last token is known: no step pending) and fitted to it after;
        a draft model fills in its tokens once their KV blocks are allocated."""
        if self.speculative is None:
            batch = self.scheduler.schedule()
            for seq in batch.preempted:
                self._release(seq)
            return batch
        start = time.perf_counter()
        if self._pending is None:
            self._propose_drafts()
        else:  # _pipeline_can_continue() found no sequence due to draft
            for seq in self.scheduler.running:
                if can_speculate(seq):
                    self.draft_policy.idle(seq)
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self._release(seq)
        self._fit_drafts(batch)
        if self.drafter is not None:
            drafted = [s for s in batch.seqs if s.num_drafts]
            if drafted:
                self.drafter.propose(drafted)
        self._clip_drafts(batch)
        self._draft_secs = time.perf_counter() - start
        return batch

    def _step_sync(self) -> list[Request]:
        batch = self._schedule()
        if not batch.seqs:
            return []
        self._mark_scheduled(batch)
        return self._run_sync(batch)

    def _run_sync(self, batch: ScheduledBatch) -> list[Request]:
        start = time.perf_counter()
        result = self.runner.execute(batch)
        drafted = []
        if self.speculative is not None:
            if all(n == 1 + s.num_drafts for s, n in zip(batch.seqs, batch.num_new_tokens)):
                # A decode step, with or without drafts: what a token costs (proposing
                # included).
                self.draft_policy.cost.observe(
                    batch.num_tokens, time.perf_counter() - start + self._draft_secs)
            drafted = [seq for seq in batch.seqs if seq.num_drafts]
            if drafted:
                result = self._verify_drafts(batch, result)
        self.scheduler.advance(batch)
        for seq in drafted:
            # The accepted drafts stay in token_ids through advance() (the prefix cache
            # hashes them); _process appends them again, one stop check at a time.
            del seq.token_ids[len(seq.token_ids) - seq.num_drafts:]
            seq.num_drafts = 0
        return self._process(result)

    # ---- speculative decoding (engine/speculative.py) -----------------------------------

    def _propose_drafts(self) -> None:
        """Append n-gram proposals to the running sequences as draft tokens."""
        threshold = self.draft_policy.threshold(len(self.scheduler.running))
        for seq in self.scheduler.running:
            if not can_speculate(seq):
                continue
            p = seq.params
            # Never past max_tokens or max_model_len: a step adds accepted drafts + 1.
            room = min(p.max_tokens - seq.num_output_tokens,
                       self.max_model_len - len(seq.token_ids)) - 1
            k = min(self.draft_policy.draft_length(seq, threshold), room)
            if k <= 0:
                self.draft_policy.idle(seq)
                continue
            self._looked_for_drafts = True
            if self.drafter is not None:
                # Placeholders: the draft model fills them in once the step is scheduled.
                drafts = [0] * k
            else:
                drafts = []
                if seq.grammar is not None:
                    # The text its grammar forces (keys, braces) costs no step of its own.
                    seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens,
                                        len(seq.token_ids))
                    drafts = seq.grammar.forced_tokens(self.tokenizer, k)
                drafts = drafts or self._ngram_index(seq).propose(seq.token_ids, k)
            if drafts:
                seq.token_ids.extend(drafts)
                seq.num_drafts = len(drafts)
            else:
                self.draft_policy.nothing_found(seq)

    def _may_find_drafts(self, seq: Sequence) -> bool:
        """Whether a sequence whose last token is still on the device may find drafts once
        it is read. For n-gram lookup: a match of n > prompt_lookup_min tokens ending at the
        unknown token needs one of n - 1 ending just before it, so a sequence whose known
        tokens end in no n-gram seen before does not stop the pipeline (it gives up only its
        shortest matches, the least likely to be accepted) and looks again next step."""
        if self.drafter is not None:
            return True
        known = len(seq.token_ids) - (seq.token_ids[-1] == PLACEHOLDER_TOKEN)
        return bool(self._ngram_index(seq).propose(seq.token_ids, 1, known))

    def _ngram_index(self, seq: Sequence) -> NgramIndex:
        if seq.ngram_index is None:
            spec = self.speculative
            seq.ngram_index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return seq.ngram_index

    def _fit_drafts(self, batch: ScheduledBatch) -> None:
        """Drop the drafts of sequences the step does not carry whole (preempted, out of
        budget): a step verifies a sequence's drafts only if it computes all of them."""
        scheduled = dict(zip((s.seq_id for s in batch.seqs), batch.num_new_tokens))
        # Drafts were proposed for running sequences; the preempted ones left the queue.
        for seq in itertools.chain(self.scheduler.running, batch.preempted):
            if not seq.num_drafts:
                continue
            # A step computes n <= 1 + num_drafts of its tokens; preempted: none.
            keep = max(0, min(seq.num_drafts, scheduled.get(seq.seq_id, 0) - 1))
            if keep < seq.num_drafts:
                del seq.token_ids[len(seq.token_ids) - (seq.num_drafts - keep):]
                seq.num_drafts = keep

    def _verify_drafts(self, batch: ScheduledBatch, result: StepResult) -> StepResult:
        """Keep each drafted sequence's confirmed drafts (and shorten its step to them) and
        return the step's result with one row per token to append: for a drafted sequence
        the accepted drafts and the target's next token, in order."""
        tokens, logprobs = result.sampled.token_ids, result.sampled.logprobs
        rows, out, out_lp = [], [], []
        n_new = dict(zip((s.seq_id for s in batch.seqs), range(len(batch.seqs))))
        r = 0
        while r < len(result.row_seqs):
            seq = result.row_seqs[r]
            k = seq.num_drafts
            if not k:
                rows.append(seq)
                out.append(tokens[r])
                out_lp.append(logprobs[r] if logprobs else None)
                r += 1
                continue
            targets = tokens[r:r + k + 1]
            drafts = seq.token_ids[len(seq.token_ids) - k:]
            a = accepted_count(drafts, targets)
            self.draft_policy.verified(seq, k, a)
            self.stats["spec_decode_num_drafts"] += 1
            self.stats["spec_decode_num_draft_tokens"] += k
            self.stats["spec_decode_num_accepted_tokens"] += a
            # The rejected drafts leave now; the step computed KV for the rest.
            del seq.token_ids[len(seq.token_ids) - (k - a):]
            seq.num_drafts = a
            seq.draft_computed = min(seq.draft_computed, len(seq.token_ids))
            # Its rows were not counted by the sampler: the tokens it keeps are, now.
            self.runner.sampler.state.count_tokens(seq, targets[:a + 1])
            batch.num_new_tokens[n_new[seq.seq_id]] -= k - a
            rows += [seq] * (a + 1)
            out += targets[:a + 1]
            out_lp += logprobs[r:r + a + 1] if logprobs else [None] * (a + 1)
            r += k + 1
        return StepResult(rows, SamplerOutput(out, out_lp), result.prompt_logprobs)

    # ---- pipelined decoding ------------------------------------------------------------
    #
    # Step N is launched and each of its sequences gets a placeholder token, so the
    # scheduler can plan step N+1 (one more token each) without knowing the values. Step
    # N+1 is launched with its input tokens read on the device from N's output; only then
    # are N's tokens (and logprobs) read back and processed (stop checks, text). A sequence
    # that stopped at N has already been given a row in N+1: that row's token is dropped.
    # The sampler needs no token values from the host (its counts live on the device), so
    # every sequence takes part; only a step with drafts is verified before the next.

    @staticmethod
    def _batch_can_pipeline(batch: ScheduledBatch) -> bool:
        return not any(s.num_drafts for s in batch.seqs)

    def _pipeline_can_continue(self) -> bool:
        """Whether the next batch can be launched before the pending step is read: every
        running sequence can pipeline and either was sampled in that step or, with the
        mixed-step runner, knows its last token (a long prompt between chunks), and any
        request that may be admitted now can join them in a mixed step launched ahead (a
        fresh one that can pipeline; a preempted one still waits for its in-flight
        token). Checked before scheduling, since scheduling over placeholders commits to
        it; a batch that then cannot be launched ahead reads the pending step first
        (step's fallback)."""
        sched = self.scheduler
        rows, mixed = self._pending.rows, self.runner.mixed_runner is not None
        if not all(s.seq_id in rows or (mixed and s.token_ids[-1] != PLACEHOLDER_TOKEN)
                   for s in sched.running):
            return False
        if self.speculative is not None:
            threshold = self.draft_policy.threshold(len(sched.running))
            if any(can_speculate(s) and self.draft_policy.draft_length(s, threshold)
                   and self._may_find_drafts(s) for s in sched.running):
                return False  # a sequence is due to draft: it needs its last token
        if not sched.waiting:
            return True
        if self.runner.mixed_runner is None:
            return False
        room = max(0, self.config.max_num_seqs - len(sched.running))
        return all(s.token_ids[-1] != PLACEHOLDER_TOKEN
                   for s in itertools.islice(sched.waiting, room))

    def _step_pipelined(self, batch: ScheduledBatch, report: Callable) -> list:
        pending = self.runner.launch_decode(batch, self._pending)
        touched = self._resolve_pending() if self._pending is not None else []
        outputs = report(touched)  # before the placeholders go in
        self.scheduler.advance(batch)
        for seq in pending.seqs:  # the rows it samples (not a prompt's unfinished chunk)
            if not seq.is_finished:
                seq.token_ids.append(PLACEHOLDER_TOKEN)
        self._pending = pending
        return outputs

    def _resolve_pending(self) -> list[Request]:
        """Read the pending step's tokens and process them like a synchronous step's."""
        pending, self._pending = self._pending, None
        sampled = pending.read()
        rows, live_tokens, live_logprobs = [], [], []
        for i, (seq, token) in enumerate(zip(pending.seqs, sampled.token_ids)):
            if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER_TOKEN:
                seq.token_ids.pop()
                rows.append(seq)
                live_tokens.append(token)
                if sampled.logprobs:
                    live_logprobs.append(sampled.logprobs[i])
            # else: the sequence stopped (or was aborted) before this step was read.
        result = StepResult(rows, SamplerOutput(live_tokens, live_logprobs), [])
        return self._process(result)

    def _process(self, result: StepResult) -> list[Request]:
        touched: dict[str, Request] = {}
        for chunk in result.prompt_logprobs:
            req = chunk.seq.request
            for offset, (lp, rank, ids, vals) in enumerate(chunk.entries):
                pos = chunk.first_position + offset
                if pos != len(req.prompt_logprobs):
                    continue
                req.prompt_logprobs.append(self._position_logprobs(
                    req.prompt_token_ids[pos], lp, rank, ids, vals, req.params.detokenize))
        now = time.monotonic()
        live = [(row, seq) for row, seq in enumerate(result.row_seqs)
                if seq.request.request_id in self.requests]  # not aborted meanwhile
        for _, seq in live:
            if seq.index > 0 and seq.status is SequenceStatus.WAITING and not seq.block_table:
                # A sibling sampled from sample 0's prompt logits: start it sharing blocks
                # (before any stop check below can free sample 0's blocks).
                self.scheduler.fork(seq.request.seqs[0], seq)
        tokens = result.sampled.token_ids
        logprobs = result.sampled.logprobs
        ended: list[Request] = []
        appended = 0
        for row, seq in live:
            if seq.is_finished:
                continue  # a speculative step's later tokens after a stop
            req = seq.request
            token = tokens[row]
            seq.token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            lp = logprobs[row] if logprobs else None
            if lp is not None:
                seq.cumulative_logprob += lp[0]
                seq.logprobs.append(self._position_logprobs(token, *lp, seq.params.detokenize))
            appended += 1
            if self._check_stop(seq, token):
                ended.append(req)
            touched[req.request_id] = req
        self.stats["generation_tokens"] += appended
        for req in touched.values():
            req.seqs[0].forks_pending = False
        for req in ended:
            if req.finished and req.finished_time is None:
                req.finished_time = now
                self._forget(req.request_id)
                self.stats["finished_requests"] += 1
        return list(touched.values())

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Finish the sequence if this token ends it; returns whether it did."""
        p = seq.params
        reason = stop_reason = None
        n_out = len(seq.token_ids) - seq.num_prompt_tokens
        if n_out >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                reason = "stop"
            elif p.stop_token_ids and token in p.stop_token_ids:
                reason, stop_reason = "stop", token
        # A stop token's text stays out of the output unless asked for (as vLLM's).
        new_len = 0
        if self.detokenizer and p.detokenize and (
                reason is None or p.include_stop_str_in_output):
            new_len = len(self.detokenizer.append_text(seq))
        if reason is None and n_out >= p.min_tokens and p.stop and (
                hit := find_stop_string(seq, new_len)) is not None:
            reason, stop_reason = "stop", hit
        if reason is None and seq.grammar is not None:
            seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids))
            if seq.grammar.matcher.is_terminated():
                reason = "stop"  # the grammar is complete and took its stop token
        if reason is None and (n_out >= p.max_tokens
                               or len(seq.token_ids) >= self.max_model_len):
            reason = "length"
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        self._release(seq)
        return True

    def _position_logprobs(self, token: int, lp: float, rank: int, ids: list[int],
                           vals: list[float], detokenize: bool = True) -> dict[int, Logprob]:
        text = (self.detokenizer.token_text if self.detokenizer and detokenize
                else (lambda t: None))
        out = {token: Logprob(lp, rank, text(token))}
        for r, (tid, val) in enumerate(zip(ids, vals), start=1):
            if tid not in out:
                out[tid] = Logprob(val, r, text(tid))
        return out

    def make_output(self, req: Request) -> RequestOutput:
        outputs = []
        for seq in req.seqs:
            text = visible_text(seq)
            token_ids = seq.output_token_ids
            if token_ids and token_ids[-1] == PLACEHOLDER_TOKEN:
                token_ids.pop()  # a pipelined step's token, not read back yet
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time,
                                 req.first_token_time, req.finished_time)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs,
                             req.finished, req.prompt_logprobs, metrics,
                             num_cached_tokens=req.seqs[0].num_cached_tokens or 0)


def freeze_startup_objects() -> None:
    """Move every object alive now (torch, transformers, the model's modules...) out of the
    cyclic GC's reach. Otherwise the collections that a step's allocations trigger scan
    them all: ~2 ms per step at batch 256 in a microbenchmark with torch loaded, against
    ~0.15 ms frozen. Frozen objects that later become cyclic garbage are never freed, and
    an engine holds reference cycles (bound methods kept as attributes): so this is for a
    process that keeps its one engine until it exits (the engine process, the server, a
    benchmark), never called by LLMEngine itself, where a user may build and drop
    several engines and must get their memory back."""
    gc.collect()
    gc.freeze()
