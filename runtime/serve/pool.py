"""N workers behind a bounded FIFO: N slots of one Generator that decodes them side by side
(runtime/batch.py), or N Generators each decoding one at a time. Each generation is read in a worker
thread (ONNX Runtime releases the GIL) and its text deltas travel to the event loop through an
asyncio.Queue."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..api import load
from ..generation import PromptTooLongError
from .schema import RETRY_AFTER_S, APIError, shutting_down

log = logging.getLogger("runtime.serve")


@dataclass(eq=False)                   # compared and hashed by identity (kept in a set)
class Job:
    prompt_ids: list[int]
    kwargs: dict                       # for Generator.events, all but cancel
    user: str | None = None            # the request's "user" field (the tests' fault_hook keys on it)
    timeout: float | None = None       # seconds from arrival the request may take (the body's "timeout")
    # Set when nobody waits for the answer any more; the runtime ends the generation at its next cycle.
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    timed_out: bool = False

    def expire(self) -> None:
        self.timed_out = True
        self.cancel.set()


def timed_out(limit: float) -> APIError:
    return APIError(504, f"the request reached its time limit of {limit:g} s before its first token",
                    type="timeout_error", code="timeout")


@dataclass
class Result:
    text: str
    finish_reason: str                 # "stop" | "length"
    completion_tokens: int
    eagle: dict                        # the response's "eagle" extension
    cached_tokens: int = 0             # prompt tokens whose caches were reused (runtime/prefix_cache.py)
    logprobs: list | None = None       # runtime.TokenLogprob of every token, where asked for


def _eagle_stats(out, worker: int, replica: str) -> dict:
    t = out.timings
    return {"tau": round(out.mean_accept_length, 4), "prefill_ms": round(t.get("prefill", 0) * 1e3, 3),
            "draft_ms": round(t.get("draft", 0) * 1e3, 3), "verify_ms": round(t.get("verify", 0) * 1e3, 3),
            "tokens_per_s": round(t.get("tokens_per_s", 0.0), 3), "worker": worker, "replica": replica}


def worker_error(e: Exception) -> APIError:
    """A worker's exception as its request's answer: the runtime's ValueErrors are the client's fault
    (bad settings, a prompt too long), anything else is ours."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, PromptTooLongError):
        return APIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    log.error("generation failed", exc_info=e)
    return APIError(500, f"the generation failed: {type(e).__name__}", type="server_error", code="internal_error")


class WorkerPool:
    """N workers (Generators, or slots of one parallel Generator), each used by one job at a time, and
    a bounded FIFO of jobs waiting for one."""

    def __init__(self, generators: list, max_queue: int, replica: str | None = None,
                 fault_hook: Callable[[Job], None] | None = None, request_timeout: float | None = None):
        """request_timeout: the most seconds a request may take from its arrival (a request's own
        "timeout" may ask for less): the generation then ends with what it has, finish_reason
        "length", or 504 where it has nothing yet."""
        if not generators:
            raise ValueError("a WorkerPool needs at least one Generator")
        self.generators = generators
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}"
        self.fault_hook = fault_hook   # called in the worker thread before generating (tests inject faults)
        self._executor = ThreadPoolExecutor(len(generators), thread_name_prefix="eagle2-worker")
        self._idle: asyncio.Queue = asyncio.Queue()
        for i in range(len(generators)):
            self._idle.put_nowait(i)
        self.waiting = 0               # requests queued for a worker
        self.busy = 0                  # workers running a job
        self.cancelled = 0             # generations ended by their cancel event
        self._count_lock = threading.Lock()
        self.jobs: set[Job] = set()    # jobs holding a worker

    @property
    def tokenizer(self):
        return self.generators[0].tokenizer

    @property
    def max_length(self) -> int:
        return self.generators[0].max_length

    @property
    def vocab_size(self) -> int:
        return self.generators[0].vocab_size

    @property
    def closed(self) -> bool:
        return self._executor._shutdown

    def time_limit(self, job: Job) -> float | None:
        limits = [t for t in (job.timeout, self.request_timeout) if t is not None]
        return min(limits) if limits else None

    async def _acquire(self, job: Job) -> int:
        if self._idle.empty() and self.waiting >= self.max_queue:
            raise APIError(429, f"the server is busy ({self.busy} generating, {self.waiting} queued); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.waiting += 1
        limit = self.time_limit(job)
        try:
            if limit is None:
                return await self._idle.get()
            return await asyncio.wait_for(self._idle.get(), job.arrived + limit - time.monotonic())
        except asyncio.TimeoutError:
            raise timed_out(limit) from None
        finally:
            self.waiting -= 1

    def _release(self, worker: int, job: Job) -> None:
        self.busy -= 1
        self.jobs.discard(job)
        self._idle.put_nowait(worker)

    async def run(self, job: Job) -> AsyncIterator[tuple]:
        """Yield ("delta", text, [TokenLogprob of the tokens since the last delta]) events, then one
        ("end", Result) or ("error", exception).
        Closing this iterator early cancels the generation."""
        worker = await self._acquire(job)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event):
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:       # the loop is gone (hard shutdown): nobody is listening
                pass

        self.busy += 1
        self.jobs.add(job)
        try:
            future = loop.run_in_executor(self._executor, self._generate, worker, job, emit)
        except BaseException:          # e.g. the executor is shut down: give the worker back
            self._release(worker, job)
            raise
        # Not before: the worker thread may still be inside the Generator after a cancel.
        future.add_done_callback(lambda _: self._release(worker, job))
        try:
            while True:
                event = await events.get()
                # Deltas that piled up while the event loop was busy go out as one chunk: fewer sends.
                while event[0] == "delta" and not events.empty():
                    following = events.get_nowait()
                    if following[0] != "delta":
                        yield event
                        event = following
                        break
                    event = ("delta", event[1] + following[1], event[2] + following[2])
                yield event
                if event[0] != "delta":
                    return
        finally:
            job.cancel.set()           # no effect once finished; stops a generation nobody waits for

    async def run_choices(self, jobs: list[Job]) -> AsyncIterator[tuple[int, tuple]]:
        """(choice, event) of every job (n choices of one prompt): the first alone until its first event,
        when its prompt is in the prefix cache for the others, then all side by side. Closing this
        iterator early cancels every generation."""
        first = self.run(jobs[0])
        event = await first.__anext__()
        yield 0, event
        if event[0] == "error" or len(jobs) == 1:
            async for event in first:
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, events):
            try:
                async for e in events:
                    await queue.put((i, e))
            finally:
                await queue.put((i, None))
        tasks = [asyncio.create_task(pump(0, first))]
        tasks += [asyncio.create_task(pump(i, self.run(job))) for i, job in enumerate(jobs[1:], 1)]
        try:
            running = len(tasks)
            while running:
                i, event = await queue.get()
                if event is None:
                    running -= 1
                else:
                    yield i, event
        finally:
            for task in tasks:
                task.cancel()
            for job in jobs:
                job.cancel.set()

    def _generate(self, worker: int, job: Job, emit) -> None:
        """Runs in a worker thread. Every outcome reaches the event loop as one final event, so the
        request's handler never waits for nothing."""
        limit, timer = self.time_limit(job), None
        try:
            if self.fault_hook is not None:
                self.fault_hook(job)
            if limit is not None:
                timer = threading.Timer(job.arrived + limit - time.monotonic(), job.expire)
                timer.daemon = True
                timer.start()
            events = self.generators[worker].events(job.prompt_ids, cancel=job.cancel, **job.kwargs)
            pending = []               # log-probabilities of tokens whose text is held back
            while True:
                try:
                    event = next(events)
                except StopIteration as done:
                    out = done.value
                    break
                pending += event.logprobs or []
                if event.text:
                    emit(("delta", event.text, pending))
                    pending = []
        except Exception as e:         # reported to this request only; the worker keeps serving
            emit(("error", e))
            return
        finally:
            if timer is not None:
                timer.cancel()
        finish, stats = out.finish_reason, _eagle_stats(out, worker, self.replica)
        if finish == "cancelled" and job.timed_out:
            if not out.token_ids:
                emit(("error", timed_out(limit)))
                return
            finish, stats["timed_out"] = "length", True
        if finish == "cancelled":
            with self._count_lock:
                self.cancelled += 1
            log.info("worker %d: generation cancelled after %d token(s) (client gone or shutdown)", worker,
                     len(out.token_ids))
            # Normally nobody reads this: a cancel means the request's handler has gone.
            emit(("error", shutting_down()))
            return
        emit(("end", Result(out.text, finish, len(out.token_ids), stats, out.timings.get("prefix_hit_tokens", 0),
                            out.logprobs)))

    def cancel_all(self) -> int:
        for job in list(self.jobs):
            job.cancel.set()
        return len(self.jobs)

    def shutdown(self) -> None:
        self.cancel_all()
        self._executor.shutdown(wait=True)
        for gen in {id(g): g for g in self.generators}.values():
            gen.close()

    @property
    def scheduler(self):
        """The batching scheduler of a pool of parallel slots over one Generator (else None)."""
        return self.generators[0].scheduler


def load_pool(artifact, workers: int, max_queue: int, provider: str = "cpu", max_length: int | None = None,
              threads: int | None = None, replica: str | None = None, fault_hook=None,
              parallel: int = 1, prefix_cache_mb: float | None = None,
              request_timeout: float | None = None, size_trees: bool = True) -> WorkerPool:
    """parallel > 1: one Generator (one copy of the model) decoding up to `parallel` requests side by
    side, batched. Else N Generators (workers), each with its own graphs and caches, each running one
    request at a time; threads per worker default to cores / N, and each worker's prefix cache holds a
    1/N share of prefix_cache_mb (of the default where None)."""
    if parallel > 1:
        if workers > 1:
            raise ValueError("--parallel decodes requests side by side over one copy of the model and --workers "
                             "loads one copy per worker: choose one")
        gen = load(artifact, provider=provider, max_length=max_length, threads=threads, parallel=parallel,
                   prefix_cache_mb=prefix_cache_mb, size_trees=size_trees)
        return WorkerPool([gen] * parallel, max_queue, replica=replica, fault_hook=fault_hook,
                          request_timeout=request_timeout)
    threads = threads or max(1, (os.cpu_count() or 1) // workers)
    gens = [load(artifact, provider=provider, max_length=max_length, threads=threads, prefix_cache_mb=prefix_cache_mb,
                 size_trees=size_trees) for _ in range(workers)]
    for gen in gens:  # before any use
        if gen.prefix_cache is not None:
            gen.prefix_cache.budget //= workers
    return WorkerPool(gens, max_queue, replica=replica, fault_hook=fault_hook, request_timeout=request_timeout)
