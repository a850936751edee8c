"""The FastAPI app: OpenAI-compatible endpoints plus vLLM's extras.

    GET  /health /ping /version /metrics /v1/models /tokenizer_info
    POST /v1/completions /v1/chat/completions /tokenize /detokenize

Sampling fields a request leaves unset take the model's generation_config.json defaults
(build_app's generation_config, vLLM's --generation-config), then OpenAI's.

Every error is {"error": {"message", "type", "param", "code"}}: validation errors are 400
(FastAPI's 422 is overridden), an unknown model 404, a full waiting queue 503, a missing or
wrong API key 401. Bad input never causes a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from .. import __version__
from ..engine.async_llm_engine import AsyncLLMEngine
from ..sampling_params import generation_config_defaults
from .dashboard import OPEN_PATHS as DASHBOARD_PAGES
from .dashboard import OPEN_PREFIX as DASHBOARD_CHARTS
from .dashboard import add_dashboard
from .metrics import CONTENT_TYPE, EngineMetrics
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                       CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                       ModelCard, ModelList, RequestError, TokenizeRequest, TokenizeResponse,
                       TokenizerInfoResponse, VersionResponse)
from .responses import ResponsesRequest, create_response
from .serving import RECEIVED_AT, OpenAIServing, OrjsonResponse, error_response
from .sse import RawSendMiddleware

logger = logging.getLogger(__name__)

_ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    415: {"model": ErrorResponse, "description": "The body is not JSON"},
    500: {"model": ErrorResponse, "description": "Engine failure"},
    503: {"model": ErrorResponse, "description": "Too many waiting requests, or shutting down"},
}
_SSE = {"text/event-stream": {"schema": {"type": "string"},
                              "description": "With stream=true: Server-Sent Events, one chunk "
                                             "object per `data:` line, then `data: [DONE]`."}}

# Cross-origin requests: any origin, method and header unless the server is told otherwise
# (--allowed-origins and the like, as vLLM's).
CORS_DEFAULTS = dict(allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                     allow_credentials=False)

# Paths that work without the API key.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/docs", "/redoc",
                        "/openapi.json", "/docs/oauth2-redirect", *DASHBOARD_PAGES})


class ReceivedAtMiddleware:
    """Pure ASGI middleware: stamps when the app first sees each HTTP request, so the
    intake histogram covers parsing, validation and tokenization up to the engine."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[RECEIVED_AT] = time.monotonic()
        return await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """Pure ASGI middleware: `Authorization: Bearer <key>` on every path but OPEN_PATHS."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or \
                path in OPEN_PATHS or path.startswith(DASHBOARD_CHARTS):
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):
            resp = error_response(401, "Invalid or missing API key: send 'Authorization: "
                                       "Bearer <key>'.", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    errors = exc.errors()
    if errors and all(tuple(e.get("loc", ()))[:2] == ("body", "prompt") for e in errors) \
            and len(errors) > 1:
        return ("prompt must be a string, a list of strings, a list of token ids, or a list "
                "of token-id lists.", "prompt")
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = err.get("msg", "invalid value")
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            msg = f"The body is not valid JSON: {ctx.get('error', 'decode error')}"
            return msg, None
        elif err.get("type") == "missing":
            msg = "field required"
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts[:8]) or "Invalid request.", param


def build_app(engine: AsyncLLMEngine, *, served_model_names: list[str] | None = None,
              api_key: str | None = None, max_num_seqs: int | None = None,
              drain_timeout: float = 5.0, metrics: EngineMetrics | None = None,
              metrics_store=None, metrics_row: int = 0,
              generation_config: str | None = None, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, cors: dict | None = None,
              chat_template: str | None = None, root_path: str = "") -> FastAPI:
    """The app around a started AsyncLLMEngine. The app's lifespan shuts the engine down
    (drain_timeout seconds for in-flight requests, then abort). generation_config: "auto",
    "vllm" or a folder (see sampling_params.generation_config_defaults); default: the
    engine's EngineConfig.generation_config where this process has it, else "auto".
    metrics_store / metrics_row: the request metrics' row in a store shared by several API
    server processes (metrics.shared_metrics_store). tool_call_parser: the tool-call
    format (hermes, llama3_json, mistral; default: the chat template's);
    reasoning_parser: deepseek_r1 or qwen3 (<think> blocks), default none. cors:
    CORSMiddleware's allow_origins, allow_methods, allow_headers, allow_credentials
    (default: any origin, method and header, as vLLM's server allows: a browser page may
    call the API). chat_template: the Jinja template chats render with instead of the
    tokenizer's. root_path: the prefix a proxy serves the API under."""
    if not served_model_names:
        served_model_names = [default_model_name(engine)]
    if max_num_seqs is None:
        eng = engine.engine
        max_num_seqs = eng.config.max_num_seqs if eng is not None else 256
    if metrics is None:
        metrics = EngineMetrics(served_model_names[0], metrics_store, metrics_row)
    if generation_config is None:
        generation_config = engine.config.generation_config if engine.config else "auto"
    sampling_defaults = generation_config_defaults(generation_config, engine.model_path)
    serving = OpenAIServing(engine, served_model_names, max_num_seqs,
                            on_intake=metrics.observe_intake,
                            sampling_defaults=sampling_defaults,
                            tool_call_parser=tool_call_parser,
                            reasoning_parser=reasoning_parser, chat_template=chat_template)
    engine.stat_loggers.append(metrics)
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown(drain_timeout)

    app_kwargs = dict(title="minivllm OpenAI-compatible server", version=__version__,
                      lifespan=lifespan, root_path=root_path)
    try:  # FastAPI >= 0.120: JSON bodies without a Content-Type are still parsed
        app = FastAPI(**app_kwargs, strict_content_type=False)
    except TypeError:
        app = FastAPI(**app_kwargs)
    app.state.engine = engine
    app.state.drain_timeout = drain_timeout
    app.state.serving = serving
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    # Outside the key check: a browser's preflight (OPTIONS) carries no key.
    app.add_middleware(CORSMiddleware, **{**CORS_DEFAULTS, **(cors or {})})
    app.add_middleware(ReceivedAtMiddleware)  # added last: the outermost, runs first
    # Outside even Starlette's error middleware: the server's own `send`, for SSE bodies.
    build_stack = app.build_middleware_stack
    app.build_middleware_stack = lambda: RawSendMiddleware(build_stack())

    # The schema says what bad input gets: a 400 in OpenAI's shape (documented per route),
    # never FastAPI's 422.
    schema_of = app.openapi

    def openapi() -> dict:
        schema = schema_of()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi

    # ---- errors -------------------------------------------------------------------------

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                              err_type=exc.err_type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        ctype = request.headers.get("content-type", "")
        if ctype and "json" not in ctype.lower():
            return error_response(415, f"Unsupported Content-Type {ctype!r}: send "
                                       "'application/json'.")
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("Unhandled error for %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")

    # ---- plain endpoints ----------------------------------------------------------------

    @app.get("/health", response_class=Response, responses={503: _ERRORS[503]})
    async def health() -> Response:
        """200 while the engine runs; 503 once it has stopped or died."""
        if not engine.is_running:
            return error_response(503, "The engine is not running.")
        return Response(status_code=200)

    @app.get("/ping", include_in_schema=False)
    async def ping() -> Response:
        return await health()

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return OrjsonResponse({"version": __version__})

    def model_cards() -> list[dict]:
        root = str(engine.model_path) if engine.model_path is not None else None
        return [{"id": name, "object": "model", "created": started, "owned_by": "minivllm",
                 "root": root, "parent": None, "max_model_len": engine.max_model_len,
                 "permission": []} for name in served_model_names]

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def models():
        return OrjsonResponse({"object": "list", "data": model_cards()})

    @app.get("/v1/models/{name:path}", response_model=ModelCard,
             responses={401: _ERRORS[401], 404: _ERRORS[404]})
    async def model(name: str):
        """One served model's card (the openai SDK's models.retrieve)."""
        for card in model_cards():
            if card["id"] == name:
                return OrjsonResponse(card)
        return error_response(404, f"The model {name!r} does not exist.", param="model",
                              code="model_not_found")

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}},
                              "description": "Prometheus text format"}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(await engine.refresh_snapshot()),
                        media_type=CONTENT_TYPE)

    add_dashboard(app, engine)

    # ---- generation ---------------------------------------------------------------------

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": _SSE}, **_ERRORS})
    async def completions(request: CompletionRequest, raw_request: Request):
        """OpenAI completions (`prompt`: string, strings, token ids or token-id lists)."""
        return await serving.create_completion(request, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: {"content": _SSE}, **_ERRORS})
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        """OpenAI chat completions, prompted through the tokenizer's chat template."""
        return await serving.create_chat_completion(request, raw_request)

    @app.post("/v1/responses", responses={200: {"content": _SSE}, **_ERRORS})
    async def responses(request: ResponsesRequest, raw_request: Request):
        """OpenAI's Responses API, over the chat path (server/responses.py); nothing is
        stored."""
        return await create_response(serving, request, raw_request)

    async def stored_response(response_id: str):
        """A stored response: none ever is."""
        raise RequestError(f"Response {response_id!r} not found: this server does not store "
                           f"responses.", 404, param="response_id")

    for method in ("GET", "DELETE"):  # a route each: each has its own operation id
        app.add_api_route("/v1/responses/{response_id}", stored_response, methods=[method],
                          name=f"{method.lower()}_response", response_class=Response,
                          responses={401: _ERRORS[401], 404: _ERRORS[404]})

    # ---- tokenizer ----------------------------------------------------------------------

    @app.post("/tokenize", response_model=TokenizeResponse,
              responses={k: _ERRORS[k] for k in (400, 401, 404)})
    async def tokenize(request: TokenizeRequest):
        """vLLM's /tokenize: `prompt` text, or `messages` rendered by the chat template."""
        serving.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise RequestError("Give exactly one of `prompt` and `messages`.", param="prompt")
        if request.messages is not None:
            text = serving.render_chat(request)
            add_special = bool(request.add_special_tokens)
        else:
            text = request.prompt
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
        ids = serving.tokenize(text, add_special)
        body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": None}
        if request.return_token_strs and serving.tokenizer is not None:
            body["token_strs"] = serving.tokenizer.convert_ids_to_tokens(ids)
        return OrjsonResponse(body)

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse,
             responses={k: _ERRORS[k] for k in (400, 401)})
    async def tokenizer_info():
        """vLLM's /tokenizer_info: the tokenizer's configuration (its tokenizer_config.json,
        JSON-safe), class, special tokens and the chat template the server renders with,
        as lm-eval's remote tokenizer reads it. 400 without a tokenizer."""
        return OrjsonResponse(serving.tokenizer_info())

    @app.post("/detokenize", response_model=DetokenizeResponse,
              responses={k: _ERRORS[k] for k in (400, 401, 404)})
    async def detokenize(request: DetokenizeRequest):
        """vLLM's /detokenize: token ids back to text."""
        serving.check_model(request.model)
        vocab = engine.vocab_size
        for t in request.tokens:
            if not 0 <= t < vocab:
                raise RequestError(f"Token id {t} is out of vocabulary (valid: 0..{vocab - 1}).",
                                   param="tokens")
        if serving.tokenizer is None:
            raise RequestError("This server has no tokenizer (skip_tokenizer_init).")
        return OrjsonResponse({"prompt": serving.decode(request.tokens)})

    return app


def default_model_name(engine: AsyncLLMEngine) -> str:
    """The model folder's name (a .gguf file: its stem)."""
    path = engine.model_path
    if path is None:
        return "minivllm"
    return path.stem if path.suffix == ".gguf" else path.name


def make_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info", access_log: bool = True, **uvicorn_kwargs):
    """A uvicorn.Server for the app whose shutdown drains the engine first: on SIGINT /
    SIGTERM (or server.should_exit) new requests get 503, in-flight ones get
    app.state.drain_timeout seconds to finish, then are aborted, so every open stream still
    ends with a finish_reason and `data: [DONE]` before connections close."""
    import uvicorn

    drain_timeout = float(app.state.drain_timeout)

    class _DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            drain = asyncio.ensure_future(app.state.engine.shutdown(drain_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                await drain

    # uvloop made uvicorn's re-raised Ctrl-C land inside the still-running loop (a
    # traceback on every clean shutdown); the asyncio loop with httptools' parser keeps
    # most of the gain.
    uvicorn_kwargs.setdefault("loop", "asyncio")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            access_log=access_log,
                            timeout_graceful_shutdown=int(drain_timeout) + 5,
                            **uvicorn_kwargs)
    return _DrainingServer(config)
