"""Server-Sent Events responses that write each chunk straight to the server's `send`.

A streamed request sends one chunk per token (or per few tokens): through Starlette's
StreamingResponse each chunk passed every middleware's `send` wrapper (six coroutine
layers), and each response ran an anyio task group with a second task listening for the
disconnect that serving.DisconnectWatcher already watches. SSEResponse sends the response
start through the wrapped `send` (the middlewares still see that the response started)
and the body through the server's own `send`, which RawSendMiddleware puts in the scope.
Without it (another server, tests driving the app directly) the body goes through the
wrapped `send` as before.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.responses import Response

# The ASGI scope key under which RawSendMiddleware keeps the server's own `send`.
RAW_SEND = "minivllm.raw_send"

SSE_HEADERS = {"Cache-Control": "no-cache"}


class RawSendMiddleware:
    """Pure ASGI middleware, the outermost layer: remembers the server's `send` in the
    scope so that SSEResponse can skip the layers in between for its body."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        return await self.app(scope, receive, send)


class SSEResponse(Response):
    """`text/event-stream` from an async iterator of ready-made byte chunks. The iterator
    is closed (its `finally` runs) however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        body_send = scope.get(RAW_SEND, send)
        try:
            async for chunk in self.chunks:
                # A gone client: uvicorn's send returns without writing; the
                # DisconnectWatcher aborts the request and the stream ends.
                await body_send({"type": "http.response.body", "body": chunk,
                                 "more_body": True})
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.chunks.aclose()  # type: ignore[attr-defined]
        if self.background is not None:  # FastAPI's BackgroundTasks, as Response runs them
            await self.background()
