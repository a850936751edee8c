"""OpenAI (and vLLM extension) request and response models.

Requests are validated by these models; unknown fields are ignored (OpenAI clients send
fields a server may not know). Responses are built as plain dicts for speed; the response
models here document their shapes in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from ..sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored; NaN / Infinity (which Python's JSON parser accepts) are not.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestError(ValueError):
    """A request the server refuses: answered with `status` and the OpenAI error shape."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None,
                 code: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.err_type = err_type


# ---- errors ------------------------------------------------------------------------------

class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared pieces -----------------------------------------------------------------------

class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 63 - 1  # torch.Generator seeds (+n for samples)


class JsonSchemaFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format (text, json_object, json_schema) and vLLM's structural_tag
    (xgrammar's {"format": ...} or the older {"structures", "triggers"})."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise RequestError("response_format json_schema needs json_schema.schema.",
                                   param="response_format")
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        tag = {k: v for k, v in (self.model_extra or {}).items()
               if k in ("format", "structures", "triggers")}
        if not tag:
            raise RequestError("response_format structural_tag needs format (or structures "
                               "and triggers).", param="response_format")
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", **tag})


# vLLM's structured_outputs fields, and the guided_* names older clients send.
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag",
                    "disable_any_whitespace", "disable_additional_properties",
                    "whitespace_pattern")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


class _SamplingFields(OpenAIBaseModel):
    """Fields that completions and chat share (OpenAI's and vLLM's)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's extension: each choice also carries its token ids (and the prompt's).
    return_token_ids: bool = False
    # minivllm's extension: the final usage chunk of a stream also carries the request's
    # timings ("metrics": queue wait and time to first token, in the engine's view).
    return_metrics: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    request_id: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs (and the
    # guided_* fields of its older releases).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _empty_stream_options(cls, data: Any) -> Any:
        # As vLLM, an empty stream_options ({}) counts as none (it asks for nothing).
        if isinstance(data, dict) and data.get("stream_options") == {}:
            data = {**data, "stream_options": None}
        return data

    def _check_stream_options(self) -> None:
        """As OpenAI and vLLM: stream_options only with stream=true."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("Stream options can only be defined when `stream=True`.",
                               param="stream_options")
        # As vLLM: the prompt's logprobs come whole, in the response (a stream would repeat
        # or delay them).
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs is not supported with stream=true.",
                               param="prompt_logprobs")

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for (at most one way of asking)."""
        asked = []
        if self.response_format is not None and self.response_format.type != "text":
            asked.append("response_format")
        if self.structured_outputs:
            asked.append("structured_outputs")
        guided = {ours: getattr(self, theirs) for theirs, ours in _GUIDED.items()
                  if getattr(self, theirs) is not None}
        if guided:
            asked.append(next(k for k, v in _GUIDED.items() if v in guided))
        if len(asked) > 1:
            raise RequestError(f"Ask for one output constraint, not {' and '.join(asked)}.",
                               param=asked[1])
        if not asked:
            return None
        param = asked[0]
        try:
            if param == "response_format":
                return self.response_format.constraint()
            if param == "structured_outputs":
                fields = {k: v for k, v in self.structured_outputs.items()
                          if k in _STRUCTURED_KEYS and v is not None}
                return StructuredOutputsParams(**fields)
            return StructuredOutputsParams(**guided)
        except RequestError:
            raise
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), param=param) from None

    def _sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, max_n: int,
                         defaults: dict | None) -> SamplingParams:
        """`defaults`: the server's sampling defaults (generation_config.json) for the
        fields the request leaves unset; OpenAI's defaults after those."""
        if self.n > max_n:
            raise RequestError(f"n must be at most {max_n} (the server's max_num_seqs), "
                               f"got {self.n}.", param="n")
        defaults = defaults or {}

        def pick(name: str, openai_default):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, openai_default)

        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        try:
            return SamplingParams(
                n=self.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", 1.0),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                logit_bias=self.logit_bias,
                structured_outputs=self.constraint(),
            )
        except RequestError:
            raise
        except ValueError as e:
            raise RequestError(str(e), param=self._field_named(str(e))) from e

    def _field_named(self, message: str) -> str | None:
        """The request field a SamplingParams error is about: its messages start with the
        field's name ("temperature must be ...")."""
        word = message.split(" ", 1)[0].rstrip(".,:")
        return word if word in type(self).model_fields else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: every chunk carries the usage so far."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


# ---- completions -------------------------------------------------------------------------

# A completion without max_tokens stops after this many tokens, as OpenAI's legacy endpoint
# and vLLM's do (cut to the room the prompt leaves); "max_tokens": null runs to the context.
COMPLETION_MAX_TOKENS = 16


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` may be a string, a list of strings, a list of token
    ids, or a list of token-id lists."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def to_sampling_params(self, max_n: int, defaults: dict | None = None) -> SamplingParams:
        self._check_stream_options()
        if self.suffix:
            raise RequestError("suffix is not supported.", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported (other than best_of == n).",
                               param="best_of")
        prompt_lp = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_lp = max(prompt_lp or 0, self.logprobs)
        max_tokens = self.max_tokens
        if "max_tokens" not in self.model_fields_set:  # capped by the server's default
            max_tokens = min(COMPLETION_MAX_TOKENS,
                             (defaults or {}).get("max_tokens") or COMPLETION_MAX_TOKENS)
        if self.echo_only:
            if self.stream:
                raise RequestError("max_tokens=0 (score the prompt only) needs stream=false.",
                                   param="max_tokens")
            max_tokens = 1  # one token is generated and dropped from the response
        return self._sampling_params(max_tokens=max_tokens, logprobs=self.logprobs,
                                     prompt_logprobs=prompt_lp, max_n=max_n,
                                     defaults=defaults)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: return the prompt (and its logprobs) and nothing more,
        as scoring clients such as lm-eval ask for (OpenAI's and vLLM's behaviour)."""
        return bool(self.echo) and self.max_tokens == 0


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- chat --------------------------------------------------------------------------------

class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extensions.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, max_n: int, defaults: dict | None = None) -> SamplingParams:
        self._check_stream_options()
        self.check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true.",
                               param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise RequestError(f"top_logprobs must be between 0 and 20, got "
                               f"{self.top_logprobs}.", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot "
                               "both be true.", param="continue_final_message")
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                     prompt_logprobs=self.prompt_logprobs, max_n=max_n,
                                     defaults=defaults)

    def check_tools(self):
        """(function tools, the name a named tool_choice forces): a 400 naming the field
        for a tool without a name, a named tool not in tools, tool_choice without tools.
        As OpenAI, tool_choice defaults to "auto" with tools and "none" without."""
        from .tool_calls import check_tools
        if self.tool_choice not in (None, "none") and not self.tools:
            raise RequestError("tool_choice is only allowed when tools are specified.",
                               param="tool_choice")
        try:
            return check_tools(self.tools, self.tool_choice)
        except ValueError as e:
            param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
            raise RequestError(str(e), param=param) from None

    @property
    def calls_tools(self) -> bool:
        """Whether the output is parsed for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = []


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


# ---- models, tokenize, detokenize ----------------------------------------------------------

class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minivllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: either `prompt` (text) or `messages` (rendered with the chat
    template), as in vLLM."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class TokenizerInfoResponse(OpenAIBaseModel):
    """GET /tokenizer_info (vLLM's): the tokenizer's configuration, as its
    tokenizer_config.json holds it (made JSON-serializable; more keys than these), plus the
    chat template the server renders with. Enough for lm-eval's remote tokenizer."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    model_max_length: int | None = None


class VersionResponse(OpenAIBaseModel):
    version: str
