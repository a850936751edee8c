"""OpenAI's Responses API (POST /v1/responses) over the chat path.

A request becomes a chat request: `instructions` a system message, `input` (a string, or
items: messages with text parts, the model's earlier function calls and their outputs) the
conversation, function tools and `tool_choice` in chat's shape, `text.format` the
response_format, `max_output_tokens` max_tokens. The chat's answer becomes the response's
output items (a reasoning item, a message with its output_text, a function_call per tool
call); a stream becomes the Responses events (response.created, output items and content
parts opened, text and argument deltas, each closed, response.completed, or
response.incomplete where max_output_tokens cut it), every event with its sequence number. Nothing is stored: `previous_response_id` is refused with the reason,
and a stored response cannot be read back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from pydantic import Field
from starlette.responses import Response

from .protocol import ChatCompletionRequest, OpenAIBaseModel, RequestError
from .serving import OpenAIServing, OrjsonResponse, _engine_error_message
from .sse import SSEResponse


# OpenAI's `include` values. Logprobs are the one a text server produces; the others ask
# for parts of items it never outputs (images, tool results, encrypted reasoning), so they
# change nothing.
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url",
              "computer_call_output.output.image_url", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources",
              "code_interpreter_call.outputs")


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses (the fields a text model can honour; unknown ones are ignored)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    user: str | None = None
    # vLLM's sampling extensions.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    request_id: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or []) or self.top_logprobs is not None

    def to_chat(self) -> ChatCompletionRequest:
        unknown = sorted(set(self.include or []) - set(INCLUDABLE))
        if unknown:
            raise RequestError(f"include: unknown value(s) {unknown}; known: "
                               f"{list(INCLUDABLE)}.", param="include")
        if self.previous_response_id is not None:
            raise RequestError("previous_response_id is not supported: this server stores "
                               "no responses; send the whole conversation in `input`.",
                               param="previous_response_id")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions \
            else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                _add_input_item(messages, item)
        if not messages:
            raise RequestError("input holds no message.", param="input")
        chat = {"model": self.model, "messages": messages, "stream": self.stream,
                "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed, "top_k": self.top_k,
                "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
                "request_id": self.request_id, "chat_template": self.chat_template,
                "chat_template_kwargs": self.chat_template_kwargs}
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        if self.wants_logprobs:
            chat.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            chat["tools"] = [_chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = _response_format((self.text or {}).get("format"))
        if response_format is not None:
            chat["response_format"] = response_format
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None})


def _text_of(content, param: str) -> str:
    """A message's text: a string, or its text parts one per line, as the chat endpoint
    joins them (other parts refused)."""
    if isinstance(content, str):
        return content
    if content is not None and not isinstance(content, list):
        raise RequestError(f"{param}: content must be a string or a list of parts.",
                           param=param)
    texts = []
    for part in content or []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            texts.append(part.get("text", part.get("refusal", "")))
        else:
            raise RequestError(f"{param}: content part {kind!r} is not supported; this server "
                               f"takes text only.", param=param)
    return "\n".join(texts)


def _add_input_item(messages: list[dict], item: dict) -> None:
    kind = item.get("type", "message")
    for field in ("call_id", "name", "arguments"):
        if field in item and not isinstance(item[field], str):
            raise RequestError(f"input: an item's {field} must be a string.", param="input")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise RequestError(f"input: a message's role must be user, assistant, system or "
                               f"developer, got {role!r}.", param="input")
        messages.append({"role": role, "content": _text_of(item.get("content"), "input")})
    elif kind == "function_call":
        call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the same turn's calls
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text_of(output, "input")})
    elif kind != "reasoning":  # the model's earlier reasoning is not prompted again
        raise RequestError(f"input: item type {kind!r} is not supported.", param="input")


def _chat_tool(tool: dict) -> dict:
    if tool.get("type") != "function":
        raise RequestError(f"tools: tool type {tool.get('type')!r} is not supported; this "
                           f"server runs function tools only.", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise RequestError(f"tool_choice: {choice.get('type')!r} is not supported.",
                       param="tool_choice")


def _response_format(fmt: dict | None) -> dict | None:
    if fmt is not None and not isinstance(fmt, dict):
        raise RequestError("text.format must be an object.", param="text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(f"text.format: type {fmt.get('type')!r} is not supported.",
                       param="text")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Builder:
    """The response object of one request, as it stands."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id = req.request_id or _id("resp")
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 finish_reason: str | None = None, error: dict | None = None) -> dict:
        req = self.req
        if status == "completed" and finish_reason == "length":
            status = "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",  # OpenAI's default, tools or not
            "tools": req.tools or [], "truncation": "disabled", "user": req.user,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details")
                                                            or {}).get("cached_tokens", 0)},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": (
                    usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)},
                "total_tokens": usage["total_tokens"]}}


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    return {"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


def _text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": logprobs or []}


def _logprobs(choice: dict) -> list:
    """A chat choice's (or chunk's) token logprobs, in the Responses shape (the same
    entries: token, logprob, bytes, top_logprobs)."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict, finish_reason: str | None,
                 logprobs: list | None = None) -> list[dict]:
    """A chat message as the Responses output: reasoning, text (with the answer's token
    logprobs, if asked), then each tool call; the last item is incomplete where
    max_output_tokens cut it."""
    out = []
    if message.get("reasoning_content"):
        out.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        out.append(_message_item(message["content"], logprobs=logprobs))
    for call in message.get("tool_calls") or []:
        out.append(_call_item(call["id"], call["function"]["name"],
                              call["function"]["arguments"]))
    if out and finish_reason == "length":
        out[-1]["status"] = "incomplete"
    return out


async def create_response(serving: OpenAIServing, req: ResponsesRequest,
                          raw_request: Request) -> Response:
    chat = await serving.start_chat(req.to_chat(), raw_request)
    build = _Builder(req, serving.model_name)
    if req.stream:
        return SSEResponse(_events(serving, chat, build))
    body = await serving.chat_body(chat)
    [choice] = body["choices"]
    return OrjsonResponse(build.response(
        "completed", output_items(choice["message"], choice["finish_reason"],
                                  _logprobs(choice)),
        body["usage"], choice["finish_reason"]))


class _Stream:
    """The events of one streamed response: the output items opened and closed in order,
    each event numbered."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict] = []   # every item opened, in output order
        self.open: dict | None = None  # the item that deltas go to
        self.calls: dict[int, dict] = {}  # a chat tool call's index -> its item

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def start(self, item: dict) -> list[bytes]:
        events = self.close()
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", output_index=index,
                                     item_id=item["id"], content_index=0,
                                     part=_text_part("")))
        return events

    def delta(self, kind: str, text: str, logprobs: list | None = None) -> list[bytes]:
        """Text (and a message's token logprobs) for the open item of this kind (opened
        first if need be)."""
        events = []
        if self.open is None or self.open["type"] != kind:
            item = _message_item("", "in_progress") if kind == "message" else \
                _reasoning_item("", "in_progress")
            events += self.start(item)
        item, index = self.open, len(self.output) - 1
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else \
            "response.reasoning_text.delta"
        extra = {}
        if kind == "message":
            extra["logprobs"] = logprobs or []
            item["content"][0]["logprobs"] += extra["logprobs"]
        events.append(self.event(name, output_index=index, item_id=item["id"],
                                 content_index=0, delta=text, **extra))
        return events

    def call(self, tool_call: dict) -> list[bytes]:
        events = []
        fn = tool_call.get("function") or {}
        if tool_call.get("id"):  # a new call: its id and name come first
            item = _call_item(tool_call["id"], fn.get("name"), "", "in_progress")
            events += self.start(item)
            self.calls[tool_call.get("index", 0)] = item
        item = self.calls.get(tool_call.get("index", 0))
        if item is not None and fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self.event("response.function_call_arguments.delta",
                                     output_index=self.output.index(item),
                                     item_id=item["id"], delta=fn["arguments"]))
        return events

    def close(self, status: str = "completed") -> list[bytes]:
        """The open item's closing events."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = status
        events = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events.append(self.event("response.output_text.done", output_index=index,
                                     item_id=item["id"], content_index=0, text=text,
                                     logprobs=item["content"][0]["logprobs"]))
            events.append(self.event("response.content_part.done", output_index=index,
                                     item_id=item["id"], content_index=0,
                                     part=item["content"][0]))
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", output_index=index,
                                     item_id=item["id"], content_index=0,
                                     text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done",
                                     output_index=index, item_id=item["id"],
                                     name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


async def _events(serving: OpenAIServing, chat, build: _Builder) -> AsyncIterator[bytes]:
    s = _Stream()
    yield s.event("response.created", response=build.response("in_progress", []))
    yield s.event("response.in_progress", response=build.response("in_progress", []))
    usage, finish = None, None
    try:
        async for chunk in serving.chat_chunks(chat):
            if "error" in chunk:
                error = {"code": "server_error", "message": chunk["error"]["message"]}
                yield s.event("error", code=error["code"], message=error["message"],
                              param=None)
                yield s.event("response.failed", response=build.response(
                    "failed", s.output, error=error))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                events = []
                if delta.get("reasoning_content"):
                    events += s.delta("reasoning", delta["reasoning_content"])
                if delta.get("content"):
                    events += s.delta("message", delta["content"], _logprobs(choice))
                for call in delta.get("tool_calls") or []:
                    events += s.call(call)
                for e in events:
                    yield e
                finish = choice.get("finish_reason") or finish
        for e in s.close("incomplete" if finish == "length" else "completed"):
            yield e
        response = build.response("completed", s.output, usage, finish)
        yield s.event(f"response.{response['status']}", response=response)  # or .incomplete
    except Exception as e:  # noqa: BLE001 - a failure past the first event: say so, end
        yield s.event("error", code="server_error", message=_engine_error_message(e),
                      param=None)
