"""SSEResponse and RawSendMiddleware on a bare ASGI app (no sockets): the response start
goes through the middlewares' `send`, the body straight to the server's, the headers are
StreamingResponse's, and the chunk iterator is closed however the response ends."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from minivllm.server.sse import RawSendMiddleware, SSEResponse


class RecordingMiddleware:
    """Records the message types that pass through its `send`."""

    def __init__(self, app, seen: list) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send):
        async def recording_send(message):
            self.seen.append(message["type"])
            await send(message)
        return await self.app(scope, receive, recording_send)


def make_app(chunks, closed: list, seen: list, raw: bool):
    async def gen():
        try:
            for c in chunks:
                yield c
        finally:
            closed.append(True)

    async def endpoint(request):
        return SSEResponse(gen())

    app = RecordingMiddleware(Starlette(routes=[Route("/s", endpoint)]), seen)
    return RawSendMiddleware(app) if raw else app


async def call(app, send_error: type[BaseException] | None = None) -> list[dict]:
    sent = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        if send_error is not None and message["type"] == "http.response.body":
            raise send_error()
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "GET", "scheme": "http", "path": "/s",
             "raw_path": b"/s", "root_path": "", "query_string": b"", "headers": [],
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("raw", [True, False])
def test_sse_stream_body_skips_the_middlewares_only_with_the_raw_send(raw):
    closed, seen = [], []
    sent = asyncio.run(call(make_app([b"data: 1\n\n", b"data: 2\n\n"], closed, seen, raw)))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache"
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, False]
    # The middlewares always see the start (they know the response began); the body only
    # without RawSendMiddleware.
    assert seen == (["http.response.start"] if raw else
                    ["http.response.start"] + ["http.response.body"] * 3)
    assert closed == [True]


def test_sse_stream_closes_its_iterator_when_sending_fails():
    closed, seen = [], []
    with pytest.raises(OSError):
        asyncio.run(call(make_app([b"data: 1\n\n"] * 3, closed, seen, True), OSError))
    assert closed == [True]  # the generator's finally ran (it aborts the engine request)
