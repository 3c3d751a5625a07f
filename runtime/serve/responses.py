"""OpenAI's response objects and chunks, server-sent events, and noticing a client that left."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response

from .pool import Result

SSE_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the answer was complete."""


def mark_gone(scope) -> None:
    """Tell the request-counting middleware to count this request as 499."""
    scope.setdefault("state", {})["client_gone"] = True


def usage(prompt_tokens: int, results: list[Result]) -> dict:
    """OpenAI's usage object over every choice (the prompt counted once, as its first choice read it:
    prompt_tokens_details.cached_tokens, the prompt tokens reused)."""
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens}}


class Shape:
    """The JSON objects of one endpoint (chat or completions) for one request."""

    def __init__(self, chat: bool, model: str, tokenizer=None, wants_logprobs: bool = False):
        """tokenizer: for the text of tokens in logprobs, where the request asked for them."""
        self.chat, self.model, self.tokenizer, self.wants_logprobs = chat, model, tokenizer, wants_logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._bytes: dict[int, bytes] = {}  # each choice's tokens given logprobs so far (completions' text_offset)

    def logprobs(self, entries: list | None, index: int = 0) -> dict | None:
        """OpenAI's logprobs object for the next tokens: chat's {"content": [...]}, or completions'
        {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [{**self._token(e.token_id, e.logprob),
                                 "top_logprobs": [self._token(i, lp) for i, lp in e.top]} for e in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            done = self._bytes.get(index, b"")
            out["text_offset"].append(len(done.decode("utf-8", errors="ignore")))
            piece = self.tokenizer.token_bytes(e.token_id)
            self._bytes[index] = done + piece
            out["tokens"].append(piece.decode("utf-8", errors="replace"))
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self._token(i, lp)["token"]: lp for i, lp in e.top})
        return out

    def _token(self, token_id: int, logprob: float) -> dict:
        piece = self.tokenizer.token_bytes(token_id)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def full(self, results: list[Result], prompt_tokens: int) -> dict:
        """The answer with every choice; the eagle extension is the first choice's (n = 1: the answer's)."""
        choices = []
        for index, result in enumerate(results):
            logprobs = self.logprobs(result.logprobs, index)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": result.text},
                                "logprobs": logprobs, "finish_reason": result.finish_reason})
            else:
                choices.append({"index": index, "text": result.text, "logprobs": logprobs,
                                "finish_reason": result.finish_reason})
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage(prompt_tokens, results), "eagle": results[0].eagle}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              logprobs: list | None = None, index: int = 0) -> dict:
        if self.chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs, index),
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": self.logprobs(logprobs, index),
                      "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, results: list[Result]) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(prompt_tokens, results)}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _watch_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request, awaitable):
    """Await `awaitable` unless the client disconnects first (then cancel it and raise ClientGone).
    Only while nothing else reads the request's receive channel."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_watch_disconnect(request.receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            mark_gone(request.scope)
            raise ClientGone()
    return work.result()


def event_stream(body: AsyncIterator[bytes], headers: dict, on_gone: Callable[[], None]) -> Response:
    """A server-sent-events response that stops its producer when the client disconnects, whatever
    ASGI spec version the server speaks (Starlette's StreamingResponse only listens below 2.4)."""
    class EventStream(Response):
        media_type = "text/event-stream"

        def __init__(self):
            super().__init__(status_code=200)
            self.body_iter, self.extra_headers = body, headers

        async def __call__(self, scope, receive, send):
            def gone():
                mark_gone(scope)
                on_gone()

            headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                       (b"x-accel-buffering", b"no")]
            headers += [(k.lower().encode(), str(v).encode()) for k, v in self.extra_headers.items()]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            producer = asyncio.ensure_future(self._produce(send, gone))
            watcher = asyncio.ensure_future(_watch_disconnect(receive))
            try:
                await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watcher.cancel()
                if not producer.done():
                    producer.cancel()
                    with contextlib.suppress(BaseException):
                        await producer
                    gone()
            if producer.done() and not producer.cancelled() and producer.exception():
                raise producer.exception()

        async def _produce(self, send, gone):
            try:
                async for data in self.body_iter:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:                # ASGI 2.4 servers: the client is gone
                gone()
            finally:
                await self.body_iter.aclose()

    return EventStream()
