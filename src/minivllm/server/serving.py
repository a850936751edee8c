"""The OpenAI completion and chat endpoints' logic: request -> engine requests -> response
or SSE stream. Kept apart from the FastAPI wiring (api_server.py).

One HTTP request becomes one engine request per prompt (completions may batch several);
each engine request carries all n samples. Choice index = prompt index * n + sample index.
Streams send the difference between successive cumulative texts, so the streamed text
joined equals the non-streamed text, and stop strings never leak (the engine holds back a
tail that could start one).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import orjson
from fastapi import Request
from starlette.responses import Response

from ..engine.async_llm_engine import (AsyncLLMEngine, EngineDeadError, EngineShuttingDownError,
                                       EngineStepError, QueueFullError, RequestAbortedError,
                                       RequestStream)
from ..engine.output_codec import DecodedOutput, materialize, sample_outputs
from ..outputs import Logprob, RequestOutput
from ..sampling_params import SamplingParams, fit_default_max_tokens
from ..tokenizer import normalize_messages, render_chat
from .chat_outputs import ChatOutputPlan, delta_of
from .chat_rendering import ChatRenderer, chat_template_of
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError
from .reasoning import PARSERS as REASONING_PARSERS
from .reasoning import CLOSE as REASONING_END
from .reasoning import reasoning_state, reasoning_tokens
from .sse import SSEResponse

logger = logging.getLogger(__name__)

# The ASGI scope key under which the app stamps (time.monotonic) a request's first sight.
RECEIVED_AT = "minivllm.received_at"


class OrjsonResponse(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def error_body(message: str, err_type: str, code: str | int | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                 413: "invalid_request_error", 415: "invalid_request_error",
                 422: "invalid_request_error", 429: "rate_limit_error",
                 500: "server_error", 503: "service_unavailable_error"}


def error_response(status: int, message: str, *, code: str | int | None = None,
                   param: str | None = None, err_type: str | None = None,
                   headers: dict | None = None) -> OrjsonResponse:
    err_type = err_type or _STATUS_TYPES.get(status, "invalid_request_error"
                                             if status < 500 else "server_error")
    return OrjsonResponse(error_body(message, err_type, code if code is not None else status,
                                     param), status_code=status, headers=headers)


def sse(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class DisconnectWatcher:
    """Calls on_disconnect() when the client closes the connection (streaming or not),
    by waiting on the ASGI receive channel once the body has been read."""

    def __init__(self, request: Request, on_disconnect: Callable[[], None]) -> None:
        self.disconnected = False
        self._on_disconnect = on_disconnect
        self._task = asyncio.get_running_loop().create_task(self._watch(request.receive))

    async def _watch(self, receive) -> None:
        try:
            while True:
                message = await receive()
                if message.get("type") == "http.disconnect":
                    break
        except Exception:  # noqa: BLE001 - a broken channel is a disconnect too
            pass
        self.disconnected = True
        self._on_disconnect()

    def stop(self) -> None:
        self._task.cancel()


@dataclass
class _Prompt:
    text: str | None  # the text, when known (for echo); None for token-id prompts
    token_ids: list[int]


@dataclass
class _ChoiceState:
    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    done: bool = False
    finish_reason: str | None = None


@dataclass
class _Job:
    """One HTTP request in flight: its engine requests and their streams."""

    request_id: str
    model: str
    created: int
    prompts: list[_Prompt]
    params: SamplingParams
    # max_tokens came from the server's defaults (generation_config.json's max_new_tokens),
    # not the request: as vLLM, it is then cut to what each prompt leaves of the context.
    default_max_tokens: bool = False
    streams: list[RequestStream] = field(default_factory=list)

    @property
    def engine_ids(self) -> list[str]:
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]


async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput | DecodedOutput]]:
    """(prompt index, newest output) as each stream advances, until all are finished. The
    outputs are stream items, not built (see RequestStream.get_latest_item): take their
    samples with sample_outputs(), or materialize() one."""
    if len(streams) == 1:
        s = streams[0]
        while not s.finished:
            yield 0, await s.get_latest_item()
        return
    tasks: dict[asyncio.Task, int] = {}
    try:
        for i, s in enumerate(streams):
            tasks[asyncio.ensure_future(s.get_latest_item())] = i
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=lambda t: tasks[t]):
                i = tasks.pop(t)
                out = t.result()
                yield i, out
                if not streams[i].finished:
                    tasks[asyncio.ensure_future(streams[i].get_latest_item())] = i
    finally:
        for t in tasks:
            t.cancel()


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 max_num_seqs: int,
                 on_intake: Callable[[float], None] | None = None,
                 sampling_defaults: dict | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, chat_template: str | None = None) -> None:
        self.engine = engine
        # SamplingParams defaults for the fields a request leaves unset (generation config).
        self.sampling_defaults = dict(sampling_defaults or {})
        self.on_intake = on_intake  # seconds from the app's first sight of a request to submission
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.tokenizer = engine.tokenizer  # the frontend's own copy (see AsyncLLMEngine)
        if chat_template is not None:  # --chat-template: every chat path renders with it
            if self.tokenizer is None:
                raise ValueError("--chat-template needs a tokenizer (not skip_tokenizer_init).")
            self.tokenizer.chat_template = chat_template
        # Without a tokenizer there is no text: stream a chunk per step of new tokens anyway.
        self.has_text = self.tokenizer is not None
        self._tokenizer_info: dict | None = None
        self.max_n = max_num_seqs
        self.accepted_model_names = set(served_model_names)
        if engine.model_path is not None:
            self.accepted_model_names.add(str(engine.model_path))
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"Unknown reasoning parser {reasoning_parser!r}; known: "
                             f"{', '.join(REASONING_PARSERS)}.")
        self.reasoning_parser = reasoning_parser
        # The tool-call format: the parser named, else the chat template's.
        self.chat_renderer = ChatRenderer(self.tokenizer, tool_call_parser)
        self.tool_format = self.chat_renderer.tool_format
        vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
        self.tool_trigger_is_token = self.tool_format.trigger in vocab
        # The token that closes a reasoning block, where the vocabulary has it as one
        # (Qwen3's, DeepSeek-R1's): reasoning tokens are counted up to it.
        self.reasoning_end_id = vocab.get(REASONING_END)

    # ---- shared steps -------------------------------------------------------------------

    def reasoning_token_count(self, token_ids, reasoning: str | None) -> int:
        return reasoning_tokens(token_ids, reasoning, self.reasoning_end_id,
                                lambda text: self.tokenizer.encode(text,
                                                                   add_special_tokens=False))

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_model_names:
            raise RequestError(f"The model `{model}` does not exist.", 404, param="model",
                               code="model_not_found", err_type="invalid_request_error")

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("This server has no tokenizer (skip_tokenizer_init): send "
                               "prompts as token ids.")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_str(self, tid: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid])

    def render_chat(self, req) -> str:
        if self.tokenizer is None:
            raise RequestError("This server has no tokenizer, so no chat template.")
        try:
            messages, kwargs = self.chat_renderer.prepare(
                [m.model_dump(exclude_none=True) for m in req.messages],
                getattr(req, "tools", None), getattr(req, "tool_choice", None),
                req.add_generation_prompt, req.continue_final_message, req.chat_template,
                req.chat_template_kwargs)
        except ValueError as e:
            raise RequestError(str(e), param="messages") from None
        try:
            return render_chat(self.tokenizer, messages, chat_template=req.chat_template,
                               **kwargs)
        except RequestError:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise RequestError(f"Could not apply the chat template: {e}",
                               param="messages") from e
        except Exception as e:  # jinja2 TemplateError and friends
            raise RequestError(f"Could not apply the chat template: {e}",
                               param="messages") from e

    def chat_plan(self, req: ChatCompletionRequest, prompt_text: str,
                  params: SamplingParams) -> ChatOutputPlan:
        """What the answer is parsed into (tool calls, reasoning), and params' constraint
        set to the grammar that holds them (and the request's own constraint) together."""
        tools, forced = req.check_tools()
        plan = ChatOutputPlan(
            fmt=self.tool_format if req.calls_tools else None, forced=forced,
            reasoning=(reasoning_state(prompt_text) if self.reasoning_parser else None))
        if plan.parses:
            try:
                params.structured_outputs = plan.constraint(
                    tools, req.tool_choice, req.parallel_tool_calls is not False,
                    params.structured_outputs, self.tool_trigger_is_token)
            except ValueError as e:
                if isinstance(e, RequestError):
                    raise
                raise RequestError(str(e), param="tools") from None
        return plan

    async def start(self, job: _Job, raw_request: Request) -> DisconnectWatcher:
        """Submit the job's engine requests (all or nothing) and watch for a disconnect.
        Refusals become RequestErrors with the right status."""
        ids = job.engine_ids
        watcher = DisconnectWatcher(raw_request, lambda: self.engine.abort(ids))
        specs = [dict(request_id=rid, prompt={"prompt": p.text, "prompt_token_ids": p.token_ids},
                      params=self._fit_max_tokens(job, p)) for rid, p in zip(ids, job.prompts)]
        received = raw_request.scope.get(RECEIVED_AT)
        if self.on_intake is not None and received is not None:
            self.on_intake(time.monotonic() - received)
        try:
            job.streams = await self.engine.add_requests(specs)
        except BaseException as e:
            watcher.stop()
            if isinstance(e, (ValueError, TypeError, OverflowError)) and not isinstance(
                    e, RequestError):
                raise RequestError(str(e), param=None) from e
            if isinstance(e, QueueFullError):
                raise RequestError(str(e), 503, code="queue_full") from e
            if isinstance(e, (EngineShuttingDownError, EngineDeadError)):
                raise RequestError(str(e), 503) from e
            raise
        return watcher

    def _fit_max_tokens(self, job: _Job, prompt: _Prompt) -> SamplingParams:
        """A default max_tokens is cut to the context the prompt leaves (vLLM's
        get_max_tokens); one the request asked for is not (too long is a 400)."""
        if not job.default_max_tokens:
            return job.params
        return fit_default_max_tokens(job.params,
                                      self.engine.max_model_len - len(prompt.token_ids))

    # ---- tokenizer ----------------------------------------------------------------------

    def tokenizer_info(self) -> dict:
        """GET /tokenizer_info (vLLM's): the tokenizer's init kwargs (its
        tokenizer_config.json) made JSON-serializable, its class, its special tokens as
        strings and the chat template this server renders with."""
        tok = self.tokenizer
        if tok is None:
            raise RequestError("This server has no tokenizer (skip_tokenizer_init), so no "
                               "tokenizer info.")
        if self._tokenizer_info is not None:
            return self._tokenizer_info
        info = _json_safe(dict(getattr(tok, "init_kwargs", None) or {}))
        for name in ("vocab_file", "merges_file"):  # file paths of the server (vLLM drops them)
            info.pop(name, None)
        info["tokenizer_class"] = type(tok).__name__
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            if value is not None:
                info[name] = str(value)
            else:
                info.pop(name, None)
        info["chat_template"] = chat_template_of(tok)
        self._tokenizer_info = info  # the tokenizer does not change
        return info

    # ---- completions --------------------------------------------------------------------

    def completion_prompts(self, req: CompletionRequest) -> list[_Prompt]:
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif len(p) == 0:
            raise RequestError("prompt must not be empty.", param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(_Prompt(item, self.tokenize(item, req.add_special_tokens)))
            else:
                if len(item) == 0:
                    raise RequestError("A token-id prompt must not be empty.", param="prompt")
                prompts.append(_Prompt(None, list(item)))
        return prompts

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(req.model)
        params = req.to_sampling_params(self.max_n, self.sampling_defaults)
        prompts = self.completion_prompts(req)
        job = _Job(_new_id("cmpl", req.request_id), self.model_name, int(time.time()),
                   prompts, params, default_max_tokens=req.max_tokens is None)
        watcher = await self.start(job, raw_request)
        if req.stream:
            return SSEResponse(self._completion_stream(job, req, watcher))
        try:
            finals = await self._collect(job)
        finally:
            watcher.stop()
            self.engine.abort([rid for rid, s in zip(job.engine_ids, job.streams)
                               if not s.finished])
        n = params.n
        choices = []
        completion_tokens = 0
        for pi, out in enumerate(finals):
            prompt = job.prompts[pi]
            for o in out.outputs:
                gen_ids, gen_lps, text = o.token_ids, o.logprobs, o.text
                if req.echo_only:  # the one generated token is not part of the answer
                    gen_ids, gen_lps, text = [], [], ""
                completion_tokens += len(gen_ids)
                logprobs = None
                if req.logprobs is not None:
                    lp = _CompletionLogprobs()
                    if req.echo:
                        self._add_completion_logprobs(lp, prompt.token_ids,
                                                      out.prompt_logprobs, req.logprobs)
                    self._add_completion_logprobs(lp, gen_ids, gen_lps, req.logprobs)
                    logprobs = lp.as_dict()
                if req.echo:
                    text = self._prompt_text(prompt) + text
                choice = {"index": pi * n + o.index, "text": text, "logprobs": logprobs,
                          "finish_reason": "length" if req.echo_only else o.finish_reason,
                          "stop_reason": None if req.echo_only else o.stop_reason}
                if req.return_token_ids:
                    choice.update(prompt_token_ids=prompt.token_ids, token_ids=list(gen_ids))
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs_json(
                        out.prompt_logprobs, prompt.token_ids, req.prompt_logprobs)
                choices.append(choice)
        prompt_tokens = sum(len(p.token_ids) for p in job.prompts)
        return OrjsonResponse({
            "id": job.request_id, "object": "text_completion", "created": job.created,
            "model": job.model, "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens)})

    def _prompt_logprobs_json(self, positions: list | None, token_ids: list[int],
                              num: int) -> list | None:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id:
        {logprob, rank, decoded_token}} for the prompt's token and the top `num` (the
        engine may hold more: echo with a larger `logprobs` asks it for those)."""
        if positions is None:
            return None
        return [None if pos is None else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank,
                     "decoded_token": self.token_str(t, lp)}
            for t, lp in pos.items() if t == tid or (lp.rank is not None and lp.rank <= num)}
            for pos, tid in zip(positions, token_ids)]

    def _prompt_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.decode(prompt.token_ids)

    def _add_completion_logprobs(self, lp: "_CompletionLogprobs", token_ids: list[int],
                                 positions: list | None, num: int) -> None:
        positions = positions or []
        for k, tid in enumerate(token_ids):
            pos = positions[k] if k < len(positions) else None
            chosen = pos.get(tid) if pos else None
            tok = self.token_str(tid, chosen)
            lp.tokens.append(tok)
            lp.text_offset.append(lp.offset)
            lp.offset += len(tok)
            if pos is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(chosen.logprob if chosen is not None else None)
            top = {}
            for t, entry in sorted(pos.items(), key=lambda kv: kv[1].rank or 0):
                if t == tid or (entry.rank is not None and entry.rank <= num):
                    top.setdefault(self.token_str(t, entry), entry.logprob)
            lp.top_logprobs.append(top)

    async def _completion_stream(self, job: _Job, req: CompletionRequest,
                                 watcher: DisconnectWatcher) -> AsyncIterator[bytes]:
        n = job.params.n
        states = [_ChoiceState() for _ in range(len(job.prompts) * n)]
        lp_states = [_CompletionLogprobs() for _ in states]
        first_chunk = [True] * len(states)
        usage_chunks = req.include_usage
        completion_tokens = 0
        last = None
        try:
            async for pi, out in merge_streams(job.streams):
                last = out
                prompt = job.prompts[pi]
                for o in sample_outputs(out):
                    ci = pi * n + o.index
                    st = states[ci]
                    if st.done:
                        continue
                    delta = _text_delta(o.text, st)
                    new_tokens = o.token_ids[st.num_tokens:]
                    finish = o.finish_reason
                    echo_now = req.echo and not st.started
                    if not delta and not echo_now and finish is None and (
                            not new_tokens or (req.logprobs is None and self.has_text)):
                        continue
                    logprobs = None
                    if req.logprobs is not None:
                        lp = lp_states[ci]
                        start = len(lp.tokens)
                        if echo_now:
                            self._add_completion_logprobs(lp, prompt.token_ids,
                                                          out.prompt_logprobs, req.logprobs)
                        self._add_completion_logprobs(
                            lp, new_tokens, (o.logprobs or [])[st.num_tokens:], req.logprobs)
                        logprobs = lp.as_dict(start)
                    if echo_now:
                        delta = self._prompt_text(prompt) + delta
                    st.started = True
                    st.num_tokens = len(o.token_ids)
                    if finish is not None:
                        st.done = True
                        completion_tokens += len(o.token_ids)
                    choice = {"index": ci, "text": delta, "logprobs": logprobs,
                              "finish_reason": finish, "stop_reason": o.stop_reason}
                    if req.return_token_ids:
                        choice["token_ids"] = new_tokens
                        if echo_now or first_chunk[ci]:
                            choice["prompt_token_ids"] = prompt.token_ids
                        first_chunk[ci] = False
                    chunk = {"id": job.request_id, "object": "text_completion",
                             "created": job.created, "model": job.model, "choices": [choice]}
                    if usage_chunks:
                        chunk["usage"] = (_usage(len(prompt.token_ids), st.num_tokens)
                                          if req.continuous_usage else None)
                    yield sse(chunk)
            if usage_chunks:
                prompt_tokens = sum(len(p.token_ids) for p in job.prompts)
                final = {"id": job.request_id, "object": "text_completion",
                         "created": job.created, "model": job.model, "choices": [],
                         "usage": _usage(prompt_tokens, completion_tokens)}
                if req.return_metrics:
                    final["metrics"] = _timings(last)
                yield sse(final)
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - engine failure: tell the client, end cleanly
            yield sse(error_body(_engine_error_message(e), "server_error", 500))
            yield SSE_DONE
        finally:
            watcher.stop()
            self.engine.abort([rid for rid, s in zip(job.engine_ids, job.streams)
                               if not s.finished])

    async def _collect(self, job: _Job) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(job.streams)
        try:
            async for i, out in merge_streams(job.streams):
                finals[i] = out
            finals = [materialize(out) for out in finals]
        except (EngineStepError, EngineDeadError, RequestAbortedError) as e:
            raise RequestError(_engine_error_message(e), 500, err_type="server_error") from e
        return finals  # type: ignore[return-value]

    # ---- chat ---------------------------------------------------------------------------

    async def create_chat_completion(self, req: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        chat = await self.start_chat(req, raw_request)
        if req.stream:
            return SSEResponse(self._chat_stream(chat))
        return OrjsonResponse(await self.chat_body(chat))

    async def start_chat(self, req: ChatCompletionRequest, raw_request: Request) -> "_Chat":
        """A chat request's engine requests submitted (the Responses API's too)."""
        self.check_model(req.model)
        params = req.to_sampling_params(self.max_n, self.sampling_defaults)
        text = self.render_chat(req)
        plan = self.chat_plan(req, text, params)
        prompt = _Prompt(text, self.tokenize(text, req.add_special_tokens))
        job = _Job(_new_id("chatcmpl", req.request_id), self.model_name, int(time.time()),
                   [prompt], params, default_max_tokens=req.max_tokens is None
                   and req.max_completion_tokens is None)
        echo_text = ""
        if req.echo and req.messages and req.messages[-1].role == "assistant":
            echo_text = normalize_messages([req.messages[-1].model_dump()])[0]["content"]
        return _Chat(req, job, prompt, plan, await self.start(job, raw_request), echo_text)

    async def chat_body(self, chat: "_Chat") -> dict:
        """The chat.completion object, once every sample has finished."""
        req, job, prompt, plan, watcher, echo_text = chat.fields()
        try:
            [final] = await self._collect(job)
        finally:
            watcher.stop()
            self.engine.abort([rid for rid, s in zip(job.engine_ids, job.streams)
                               if not s.finished])
        choices = []
        completion_tokens = reasoning_tokens = 0
        top_n = req.top_logprobs or 0
        for o in final.outputs:
            completion_tokens += len(o.token_ids)
            logprobs = None
            if req.logprobs:
                logprobs = {"content": self._chat_logprobs(o.token_ids, o.logprobs, top_n)}
            message = {"role": "assistant", "content": echo_text + o.text}
            finish_reason = o.finish_reason
            if plan.parses:
                parser = plan.parser()
                parser.feed(o.text)
                parser.finish()
                message = parser.message(echo_text)
                finish_reason = parser.finish_reason(o.finish_reason)
                reasoning_tokens += self.reasoning_token_count(
                    o.token_ids, message.get("reasoning_content"))
            choice = {"index": o.index, "message": message,
                      "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": o.stop_reason}
            if req.return_token_ids:
                choice.update(prompt_token_ids=prompt.token_ids, token_ids=list(o.token_ids))
            choices.append(choice)
        body = {"id": job.request_id, "object": "chat.completion", "created": job.created,
                "model": job.model, "choices": choices,
                "usage": _usage(len(prompt.token_ids), completion_tokens,
                                final.num_cached_tokens,
                                reasoning_tokens if self.reasoning_parser else None)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_json(
                final.prompt_logprobs, prompt.token_ids, req.prompt_logprobs)
        return body

    def _chat_logprobs(self, token_ids: list[int], positions: list | None,
                       top_n: int) -> list[dict]:
        content = []
        positions = positions or []
        for k, tid in enumerate(token_ids):
            pos = positions[k] if k < len(positions) else {}
            chosen = pos.get(tid)
            tok = self.token_str(tid, chosen)
            tops = sorted(((t, e) for t, e in pos.items()
                           if e.rank is not None and e.rank <= top_n),
                          key=lambda te: te[1].rank)
            content.append({
                "token": tok, "logprob": chosen.logprob if chosen is not None else None,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [{"token": (s := self.token_str(t, e)), "logprob": e.logprob,
                                  "bytes": list(s.encode("utf-8"))} for t, e in tops]})
        return content

    async def _chat_stream(self, chat: "_Chat") -> AsyncIterator[bytes]:
        async for c in self.chat_chunks(chat):
            yield sse(c)
        yield SSE_DONE

    async def chat_chunks(self, chat: "_Chat") -> AsyncIterator[dict]:
        """The chat.completion.chunk objects of a streamed chat, the usage chunk if asked;
        an engine failure ends them with an error object ({"error": ...})."""
        req, job, prompt, plan, watcher, echo_text = chat.fields()
        n = job.params.n
        states = [_ChoiceState() for _ in range(n)]
        parsers = [plan.parser() for _ in range(n)] if plan.parses else None
        last = None
        usage_chunks = req.include_usage
        top_n = req.top_logprobs or 0
        completion_tokens = reasoning_tokens = 0

        prompt_tokens = len(job.prompts[0].token_ids)

        def chunk(choice: dict) -> dict:
            c = {"id": job.request_id, "object": "chat.completion.chunk",
                 "created": job.created, "model": job.model, "choices": [choice]}
            if usage_chunks:
                c["usage"] = (_usage(prompt_tokens, states[choice["index"]].num_tokens)
                              if req.continuous_usage else None)
            return c

        try:
            for i in range(n):  # the role first, before any token
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
                if echo_text:
                    yield chunk({"index": i, "delta": {"content": echo_text},
                                 "logprobs": None, "finish_reason": None})
            async for _, out in merge_streams(job.streams):
                last = out
                for o in sample_outputs(out):
                    st = states[o.index]
                    if st.done:
                        continue
                    delta = _text_delta(o.text, st)
                    new_tokens = o.token_ids[st.num_tokens:]
                    finish = o.finish_reason
                    if not delta and finish is None and (
                            not new_tokens or (not req.logprobs and self.has_text)):
                        continue
                    logprobs = None
                    if req.logprobs:
                        logprobs = {"content": self._chat_logprobs(
                            new_tokens, (o.logprobs or [])[st.num_tokens:], top_n)}
                    st.num_tokens = len(o.token_ids)
                    if finish is not None:
                        st.done = True
                        completion_tokens += len(o.token_ids)
                    if parsers is not None:
                        parser = parsers[o.index]
                        for c in self._parsed_chunks(parser, o.index, delta, finish,
                                                     o.stop_reason, logprobs,
                                                     new_tokens if req.return_token_ids
                                                     else None):
                            yield chunk(c)
                        if finish is not None and parser.reasoning is not None:
                            # Counted once the parser has released the text it held.
                            reasoning_tokens += self.reasoning_token_count(
                                o.token_ids, parser.reasoning.reasoning)
                        continue
                    choice = {"index": o.index, "delta": {"content": delta} if delta else {},
                              "logprobs": logprobs, "finish_reason": finish,
                              "stop_reason": o.stop_reason}
                    if req.return_token_ids:
                        choice["token_ids"] = new_tokens
                    yield chunk(choice)
            if usage_chunks:
                final = {"id": job.request_id, "object": "chat.completion.chunk",
                         "created": job.created, "model": job.model, "choices": [],
                         "usage": _usage(prompt_tokens, completion_tokens,
                                         getattr(last, "num_cached_tokens", 0),
                                         reasoning_tokens if self.reasoning_parser else None)}
                if req.return_metrics:
                    final["metrics"] = _timings(last)
                yield final
        except Exception as e:  # noqa: BLE001 - engine failure: tell the client, end cleanly
            yield error_body(_engine_error_message(e), "server_error", 500)
        finally:
            watcher.stop()
            self.engine.abort([rid for rid, s in zip(job.engine_ids, job.streams)
                               if not s.finished])


    @staticmethod
    def _parsed_chunks(parser, index: int, delta: str, finish: str | None, stop_reason,
                       logprobs, token_ids: list[int] | None) -> list[dict]:
        """A step's chunks of a choice whose text is parsed (reasoning, tool calls): one
        per event, the step's logprobs and token ids on the first, the finish reason on
        the last."""
        events = parser.feed(delta) if delta else []
        if finish is not None:
            events += parser.finish()
        if not events and finish is None and logprobs is None and token_ids is None:
            return []  # held back (a possible tool call's opening): nothing to say yet
        choices = [{"index": index, "delta": delta_of(e, parser), "logprobs": None,
                    "finish_reason": None} for e in events]
        if not choices or finish is not None:
            choices.append({"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": None})
        if finish is not None:
            choices[-1]["finish_reason"] = parser.finish_reason(finish)
            choices[-1]["stop_reason"] = stop_reason
        choices[0]["logprobs"] = logprobs
        if token_ids is not None:
            choices[0]["token_ids"] = token_ids
        return choices


@dataclass
class _Chat:
    """A chat request under way: what its body or its chunks are made from."""

    req: ChatCompletionRequest
    job: _Job
    prompt: _Prompt
    plan: ChatOutputPlan
    watcher: DisconnectWatcher
    echo_text: str

    def fields(self) -> tuple:
        return self.req, self.job, self.prompt, self.plan, self.watcher, self.echo_text


@dataclass
class _CompletionLogprobs:
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0

    def as_dict(self, start: int = 0) -> dict:
        return {"text_offset": self.text_offset[start:], "token_logprobs":
                self.token_logprobs[start:], "tokens": self.tokens[start:],
                "top_logprobs": self.top_logprobs[start:]}


_INT64 = (-(2 ** 63), 2 ** 64 - 1)  # what JSON (orjson) carries as an integer
_DROP = object()


def _json_safe(value):
    """`value` with what JSON cannot carry converted or left out: an AddedToken becomes its
    content (as a value of its own) or its tokenizer_config.json dict (inside
    added_tokens_decoder); dict keys become strings; tuples and sets lists; anything else
    that is not JSON (objects, paths, integers past 64 bits, NaN) is dropped."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if _INT64[0] <= value <= _INT64[1] else _DROP
    if isinstance(value, float):
        return value if math.isfinite(value) else _DROP
    if _is_added_token(value):
        return str(value.content)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "added_tokens_decoder" and isinstance(v, dict):
                v = {t: (_added_token_dict(a) if _is_added_token(a) else a) for t, a in v.items()}
            if not isinstance(k, (str, int, float, bool)):
                continue
            v = _json_safe(v)
            if v is not _DROP:
                out[str(k)] = v
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        return [v for v in map(_json_safe, value) if v is not _DROP]
    return _DROP


def _is_added_token(value) -> bool:
    return type(value).__name__ == "AddedToken" and hasattr(value, "content")


def _added_token_dict(token) -> dict:
    """An AddedToken as tokenizer_config.json writes it in added_tokens_decoder."""
    fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    return {f: getattr(token, f) for f in fields if hasattr(token, f)}


def _text_delta(text: str, st: _ChoiceState) -> str:
    """The new part of a cumulative text. The engine only ever extends what it has shown
    (it holds back possible stop-string starts), so this is a plain suffix."""
    if len(text) < st.text_len:  # should not happen; never resend or go backwards
        logger.warning("output text shrank (%d -> %d chars)", st.text_len, len(text))
        return ""
    delta = text[st.text_len:]
    st.text_len = len(text)
    return delta


def _engine_error_message(e: BaseException) -> str:
    if isinstance(e, (EngineStepError, EngineDeadError, RequestAbortedError)):
        return str(e)
    logger.exception("unexpected error while streaming", exc_info=e)
    return f"Internal error while generating: {type(e).__name__}: {e}"


def _timings(out) -> dict | None:
    """A request's timings as the engine saw them (return_metrics): seconds from its
    arrival to its first step (the queue wait) and to its first token."""
    m = getattr(out, "metrics", None) if out is not None else None
    if m is None or m.first_scheduled_time is None:
        return None

    def since(t):
        return None if t is None else round(t - m.arrival_time, 6)
    return {"queue_s": since(m.first_scheduled_time), "ttft_s": since(m.first_token_time)}


def _usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None,
           reasoning: int | None = None) -> dict:
    """OpenAI's usage; `cached`: the prompt tokens the prefix cache held (a chat's final
    usage carries them, as OpenAI's prompt_tokens_details); `reasoning`: the completion's
    reasoning tokens (with a reasoning parser; completion_tokens_details)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def _new_id(prefix: str, given: str | None) -> str:
    return given if given else f"{prefix}-{uuid.uuid4().hex}"
