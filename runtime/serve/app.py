"""The FastAPI app: routes, authentication, and the path of a generation request from its body to
its answer (JSON or server-sent events)."""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .metrics import CountRequests, Metrics
from .pool import Job, Result, WorkerPool, worker_error
from .responses import SSE_DONE, ClientGone, Shape, event_stream, mark_gone, sse, until_disconnect, usage
from .schema import (APIError, ChatRequest, CompletionRequest, chat_prompt, check_prompt, completion_prompt,
                     generation_kwargs, parse_request, shutting_down)

log = logging.getLogger("runtime.serve")

MAX_BODY_BYTES = 1 << 20       # a larger request body is refused with 413


async def read_json(request, limit: int = MAX_BODY_BYTES):
    """Read by hand rather than by FastAPI so that every bad body gets OpenAI's error shape, and the
    size limit also holds for a chunked body without Content-Length."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:     # (UnicodeDecodeError is a ValueError)
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def check_auth(request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


@dataclass
class ServerState:
    pool: WorkerPool
    model_id: str                      # the artifact directory's name
    aliases: set                       # other names accepted for it (the manifest's model source)
    api_key: str | None
    metrics: Metrics
    created: int
    draining: bool = False             # set by SIGTERM (main.py): new requests get 503
    served: int = 0                    # generations completed (for the drain log)


def model_names(artifact, manifest: dict) -> tuple[str, set]:
    model_id = Path(artifact).resolve().name
    source = manifest.get("model", {}).get("source")
    return model_id, {source} if source else set()


def create_app(pool: WorkerPool, artifact, api_key: str | None = None) -> FastAPI:
    """The app serving `pool` (whose Generators were loaded from `artifact`)."""
    model_id, aliases = model_names(artifact, pool.generators[0].manifest)
    manifest_file = Path(artifact) / "manifest.json"
    state = ServerState(pool, model_id, aliases, api_key, Metrics(pool),
                        int(manifest_file.stat().st_mtime) if manifest_file.exists() else int(time.time()))
    app = FastAPI(title="eagle2-deploy OpenAI-compatible server", lifespan=lifespan(state), docs_url=None,
                  redoc_url=None)
    app.state.server = state
    app.add_middleware(CountRequests, metrics=state.metrics)
    add_error_handlers(app)
    add_routes(app, state)
    return app


def lifespan(state: ServerState):
    pool = state.pool

    @contextlib.asynccontextmanager
    async def run(app):
        decoding = f"{pool.generators[0].describe_default()}; {pool.generators[0].describe_prefix_cache()}"
        if pool.scheduler is not None:
            log.info("serving model '%s': up to %d requests decoded side by side over one copy, queue %d; %s",
                     state.model_id, len(pool.generators), pool.max_queue, decoding)
        else:
            log.info("serving model '%s' with %d worker(s), queue %d; %s", state.model_id, len(pool.generators),
                     pool.max_queue, decoding)
        yield
        # uvicorn has stopped accepting connections and waited for the open ones (or timed out).
        left = pool.cancel_all()
        if left:
            log.warning("drain: %d generation(s) still running at shutdown were cancelled", left)
        pool.shutdown()
        log.info("drained: %d generation(s) completed in all, %d cancelled; exiting", state.served, left)

    return run


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape (schema.APIError)."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(request, exc):
        mark_gone(request.scope)
        return PlainTextResponse("", status_code=499)   # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
                        ).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return APIError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc):
        log.error("unexpected error on %s", request.url.path, exc_info=exc)
        return APIError(500, "internal server error", type="server_error").response()


def add_routes(app: FastAPI, state: ServerState) -> None:
    pool = state.pool

    @app.get("/health")
    async def health():
        scheduler = pool.scheduler
        broken = scheduler is not None and not scheduler.healthy
        body = {"status": "draining" if state.draining else "unhealthy" if broken else "ok", "model": state.model_id,
                "workers": len(pool.generators), "busy": pool.busy, "queued": pool.waiting,
                "replica": pool.replica}
        if broken:
            body["error"] = f"the batching scheduler failed: {scheduler.fault!r}"
        return JSONResponse(body, status_code=503 if state.draining or broken else 200)

    @app.get("/metrics")
    async def prometheus():
        body, media_type = state.metrics.exposition()
        return Response(body, media_type=media_type)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request, state.api_key)
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "eagle2-deploy", "max_model_len": pool.max_length,
                                            "precision": pool.generators[0].manifest.get("precision")}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(state, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(state, request, chat=False)


async def generate(state: ServerState, request, chat: bool) -> Response:
    """One generation request, from its body to its answer (JSON, or server-sent events with stream)."""
    pool = state.pool
    start = time.perf_counter()
    endpoint = request.url.path
    check_auth(request, state.api_key)
    if state.draining:
        raise shutting_down()
    req = parse_request(ChatRequest if chat else CompletionRequest, await read_json(request))
    if req.model is not None and req.model != state.model_id and req.model not in state.aliases:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{state.model_id}'",
                       param="model", code="model_not_found")
    # Templates and tokenizers are slow enough to stall every open stream if run on the loop.
    if chat:
        ids = await run_in_threadpool(chat_prompt, pool.tokenizer, req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        ids = await run_in_threadpool(completion_prompt, pool.tokenizer, req.prompt)
        max_tokens = req.max_tokens
    check_prompt(ids, max_tokens, pool.max_length, pool.vocab_size)
    jobs = choices(req, ids, generation_kwargs(req, max_tokens))
    shape = Shape(chat, req.model or state.model_id, pool.tokenizer, jobs[0].kwargs["logprobs"] is not None)
    events = pool.run_choices(jobs)
    headers = {"X-Replica-Id": pool.replica}
    try:
        # Until the first event the request may be queued (or refused with 429); watching for a
        # disconnect here lets a queued request leave without ever reaching a worker.
        first = await until_disconnect(request, events.__anext__())
    except BaseException:
        await events.aclose()
        raise
    if first[1][0] == "error":         # nothing sent yet: still an HTTP status, even when streaming
        await events.aclose()
        raise worker_error(first[1][1])
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = stream_body(state, shape, first, events, len(jobs), len(ids), include_usage, endpoint, start)
        return event_stream(body, headers, on_gone=lambda: [job.cancel.set() for job in jobs])
    results = await until_disconnect(request, collect(first, events, len(jobs)))
    if isinstance(results, APIError):
        raise results
    state.metrics.ttft.labels(endpoint).observe(time.perf_counter() - start)
    done(state, endpoint, len(ids), results, start)
    return JSONResponse(shape.full(results, len(ids)), headers=headers)


def choices(req, ids: list[int], kwargs: dict) -> list[Job]:
    """One job per choice (n); a seeded request's choices draw with seeds seed, seed + 1, ..."""
    seed = kwargs["seed"]
    return [Job(ids, {**kwargs, "seed": None if seed is None else seed + i}, req.user, req.timeout)
            for i in range(req.n)]


async def collect(first, events, n: int) -> list[Result] | APIError:
    """Every choice's Result, or the first error."""
    results: list[Result | None] = [None] * n
    index, event = first
    try:
        while True:
            if event[0] == "error":
                return worker_error(event[1])
            if event[0] == "end":
                results[index] = event[1]
                if all(r is not None for r in results):
                    return results
            index, event = await events.__anext__()
    finally:
        await events.aclose()


def done(state: ServerState, endpoint, prompt_tokens, results: list[Result], start) -> None:
    state.served += 1
    for i, result in enumerate(results):  # the prompt counted once
        state.metrics.record(endpoint, prompt_tokens if i == 0 else 0, result, time.perf_counter() - start)


async def stream_body(state: ServerState, shape: Shape, first, events, n: int, prompt_tokens: int,
                      include_usage: bool, endpoint, start):
    """(chat: a role chunk per choice), one chunk per text delta of a choice, a final chunk per choice
    with its finish reason and eagle extension, (a usage chunk), then [DONE]. A worker error after the
    headers went out becomes an error event, as OpenAI's API sends one."""
    (index, event), first_text = first, True
    sent, results = [0] * n, [None] * n  # sent: each choice's tokens whose logprobs went out
    try:
        if shape.chat:
            for i in range(n):
                yield sse(shape.chunk(text="", role=True, index=i))
        while True:
            if event[0] == "delta":
                if first_text:
                    state.metrics.ttft.labels(endpoint).observe(time.perf_counter() - start)
                    first_text = False
                sent[index] += len(event[2])
                yield sse(shape.chunk(text=event[1], logprobs=event[2] if shape.wants_logprobs else None, index=index))
            elif event[0] == "end":
                result = results[index] = event[1]
                # Tokens without text of their own (an end-of-turn token) get their logprobs here.
                rest = result.logprobs[sent[index]:] if result.logprobs is not None else None
                final = shape.chunk(text=None if shape.chat else "", finish_reason=result.finish_reason, logprobs=rest,
                                    index=index)
                final["eagle"] = result.eagle
                ended = all(r is not None for r in results)
                if ended and not include_usage:
                    final["usage"] = usage(prompt_tokens, results)
                yield sse(final)
                if ended:
                    if include_usage:
                        yield sse(shape.usage_chunk(prompt_tokens, results))
                    yield SSE_DONE
                    done(state, endpoint, prompt_tokens, results, start)
                    return
            else:
                yield sse(worker_error(event[1]).body())
                yield SSE_DONE
                return
            index, event = await events.__anext__()
    finally:
        await events.aclose()
