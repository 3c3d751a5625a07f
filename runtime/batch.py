"""Continuous batching: many generations over one engine, their steps packed into one graph call.

One thread runs the Scheduler. Every generation runs until it needs a graph step: the draft's (its
context rows, or one frontier of its tree) or the base's (a prompt chunk, or its tree to verify).
Each step of a graph holds the rows of every generation waiting for it, each row attending only to
its own sequence (runtime/engine.Engine.run); between the draft's steps and the base's, EAGLE-2's
rerank may share the base step's rows among the trees (row_budget). From `plain_from` generations in
flight on (what `runtime tune --batch` measured), generations take plain steps instead of drafting:
once the cores are busy, a tree's extra rows cost more than they land. Generations join between
steps when one of the engine's sequence slots is free, first come first served, and leave when they
end.

A step holds at most the engine's step_rows rows: the generations whose rows do not fit wait for
the next step, those that waited first going first. Prompt chunks go in steps of their own, so that
a long prompt neither stalls the others nor pads their rows, and share one only where that pads the
attention by no more than their own rows (Scheduler._joins). Since every row is computed as it would
be alone, each generation's tokens are those it gets decoded alone, greedy or with a seed.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

from eagle2 import share_rows

from .engine import Engine, NoRoom, Rows
from .generation import Decoder, Settings, TreeSize, check_request

FINISHED = None  # the queue's last item
log = logging.getLogger("runtime.batch")


@dataclass(eq=False)
class Request:
    prompt: list[int]
    settings: Settings
    stop_ids: set[int]
    constraint: object = None          # a grammar for its tokens (runtime/constraints.py)
    tokens: queue.Queue = field(default_factory=queue.Queue)  # lists of new tokens, then an exception or FINISHED
    decoder: Decoder | None = None
    steps: object = None               # the decoder's steps() generator
    pending: Rows | TreeSize | None = None
    waited: int = 0                    # steps its pending rows have waited
    abandoned: bool = False

    def cancel(self) -> None:
        """End the generation at its next step (nobody reads it any more)."""
        self.abandoned = True


class Scheduler:
    def __init__(self, engine: Engine, row_budget: int | None = None, plain_from: int | None = None):
        """row_budget: tree rows of one verify step for all generations (None: each its own tree; the
        step's rows are still at most the engine's step_rows). plain_from: with this many generations
        decoding or more, they draft no trees (seeded sampled ones excepted); None: always trees."""
        if not engine.slotted:
            raise ValueError("this artifact's graphs hold one sequence at a time (fused attention, a torch graph, or "
                             "an export before sequence slots): re-export it to decode sequences side by side")
        self.engine, self.row_budget, self.plain_from = engine, row_budget, plain_from
        engine.release_solo()  # its slot goes to the scheduler's sequences
        self._waiting: list[Request] = []
        self._active: list[Request] = []
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Set while the scheduler cannot be trusted to serve: a fault it could not clean up after
        # (cleared by the next step that runs), or its thread's end. /health reports it.
        self.fault: BaseException | None = None
        self._dead = False  # the thread ended other than by stop()
        self.steps = 0
        self.rows = 0            # rows of all the base steps run

    # --- requests ---------------------------------------------------------------------------
    def submit(self, prompt: list[int], settings: Settings, stop_ids: set[int], constraint=None) -> Request:
        """Queue a generation; its token lists arrive on request.tokens. Bad settings and prompts
        raise here, in the caller's thread."""
        check_request(self.engine, prompt, settings)
        request = Request(list(prompt), settings, stop_ids, constraint)
        with self._lock:
            if self._stopping or self._dead:
                raise RuntimeError(f"the scheduler is stopped{f': {self.fault}' if self.fault else ''}")
            self._waiting.append(request)
            self._lock.notify()
        return request

    def cancel(self, request: Request) -> None:
        """End a generation: at once while it waits for a slot, else before the scheduler's next step
        (while its prompt is being filled too)."""
        with self._lock:
            if request in self._waiting:
                self._waiting.remove(request)
                request.tokens.put(FINISHED)
                return
        request.cancel()

    @property
    def healthy(self) -> bool:
        return self.fault is None and not self._dead

    @property
    def load(self) -> tuple[int, int]:
        """(generations decoding, generations waiting for a slot)."""
        with self._lock:
            return len(self._active), len(self._waiting)

    # --- the loop ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._supervise, name="eagle2-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Cancel every generation and end the loop."""
        with self._lock:
            self._stopping = True
            for r in self._waiting + self._active:
                r.cancel()
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _supervise(self) -> None:
        """The thread: the loop, and if anything ends it other than stop(), every generation it
        held or queued fails with the reason rather than waiting forever, and submit() refuses."""
        try:
            self._loop()
        except BaseException as e:
            self.fault = e
            log.critical("the scheduler's thread ended", exc_info=e)
            with self._lock:
                self._dead = True
                held, self._waiting, self._active = self._waiting + self._active, [], []
            for r in held:
                r.tokens.put(RuntimeError(f"the scheduler stopped: {e!r}"))
            raise

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._active or self._stopping):
                    self._lock.wait()
                if self._stopping and not (self._waiting or self._active):
                    return
            try:
                self.step()
                self.fault = None
            except Exception as e:  # a fault of the scheduler itself: fail what it holds, keep serving
                log.error("the scheduler's step failed", exc_info=e)
                self._fail_active(e)

    def _fail_active(self, e: Exception) -> None:
        """Every generation in flight ends with `e`. Where freeing one's slot fails too, the engine's
        state is unknown: the fault stands (unhealthy) until a step runs again."""
        for r in list(self._active):
            try:
                self._end(r, e)
            except Exception as again:
                self.fault = again
                log.error("freeing a failed generation's slot failed", exc_info=again)

    def step(self) -> None:
        """Admit what fits; then draft steps until every generation waits for the base (each draft
        step holds every generation's next draft rows; trees are sized between them), the head's
        prompt chunks in the first only; then one base step. Each generation goes on to its next
        step's rows as soon as its outputs are in. So a long prompt, and the head's catch-up on it,
        take one chunk a step of each graph: the others wait at most a chunk."""
        self._drop_cancelled()
        self._admit()
        for r in list(self._active):
            if r.pending is None:
                self._advance(r)
        chunks = True
        while True:
            sizing = [r for r in self._active if isinstance(r.pending, TreeSize)]
            for r, size in zip(sizing, self._tree_sizes([r.pending for r in sizing])):
                r.pending = None
                self._advance(r, size)
            if not self._run("draft", chunks):
                break
            chunks = False
        self._run("base")

    def _run(self, graph: str, chunks: bool = True) -> bool:
        """Steps of `graph` over the rows waiting for it that fit: trees and draft frontiers in one,
        prompt chunks (unless `chunks` is False) in another (those that waited first go first);
        whether any ran."""
        ran = False
        for prompt in (False, True) if chunks else (False,):
            ready = sorted((r for r in self._active if isinstance(r.pending, Rows) and r.pending.graph == graph
                            and r.pending.prompt == prompt), key=lambda r: -r.waited)
            parts, rows = [], 0
            for r in ready:
                if self._joins(parts, rows, r.pending):
                    parts.append(r)
                    rows += r.pending.rows
                else:
                    r.waited += 1
            if not parts:
                continue
            ran = True
            try:
                self.engine.run([r.pending for r in parts])
            except Exception as e:  # the step failed: every generation in it gets the error
                for r in parts:
                    self._end(r, e)
                continue
            if graph == "base":
                self.steps += 1
                self.rows += rows
            for r in parts:
                r.pending, r.waited = None, 0
                self._advance(r)
        return ran

    def _joins(self, parts: list[Request], rows: int, part: Rows) -> bool:
        """Whether `part` joins a step holding `parts` (`rows` rows). The step's attention runs over
        every sequence slot between its first and its last, each padded to its longest part's rows:
        a prompt chunk joins only while those padded rows stay within twice the step's own, since a
        long chunk beside a far or short one costs the attention more than the step it saves."""
        rows += part.rows
        if rows > self.engine.step_rows:
            return False
        if not part.prompt or not parts:
            return True
        held = [r.pending for r in parts] + [part]
        slots = [p.seq.slot for p in held]
        return (max(slots) - min(slots) + 1) * max(p.rows for p in held) <= 2 * rows

    def _admit(self) -> None:
        with self._lock:
            while self._waiting:
                r = self._waiting[0]
                if r.abandoned:
                    self._waiting.pop(0)
                    r.tokens.put(FINISHED)
                    continue
                try:
                    seq = self.engine.open_sequence()
                except NoRoom:
                    break
                self._waiting.pop(0)
                try:
                    r.decoder = Decoder(self.engine, r.prompt, r.settings, r.stop_ids, seq=seq,
                                        speculate=None if r.settings.seeded_sampling else self._speculate,
                                        constraint=r.constraint, side_by_side=self._side_by_side)
                except Exception as e:  # settings this generation cannot run with (a bad seed, say)
                    self.engine.close_sequence(seq)
                    r.tokens.put(e)
                    continue
                r.steps = r.decoder.steps()
                self._active.append(r)

    def _drop_cancelled(self) -> None:
        """Generations cancelled since the last step end now, their pending rows unrun (a prompt chunk's
        too): their slots are free for the next to be admitted."""
        for r in list(self._active):
            if r.abandoned:
                if not r.decoder.finish_reason:
                    r.decoder.finish("cancelled")
                self._end(r, FINISHED)

    def _side_by_side(self) -> int:
        return max(len(self._active), 1)

    def _speculate(self) -> bool:
        """Whether a generation starting a cycle drafts a tree at the present load."""
        return self.plain_from is None or len(self._active) < self.plain_from

    def _tree_sizes(self, trees: list[TreeSize]) -> list[int]:
        """Each tree's size: what it wants, or within row_budget its share of the step by EAGLE-2's
        rerank across the trees (eagle2.share_rows); fixed trees and lookup branches come first."""
        if self.row_budget is None:
            return [t.wanted for t in trees]
        shared = [t for t in trees if not t.fixed]
        budget = self.row_budget - sum(t.wanted for t in trees if t.fixed) - sum(t.lookup for t in trees)
        sizes = iter(share_rows([t.scores for t in shared], [t.wanted for t in shared], budget))
        return [t.wanted if t.fixed else next(sizes) for t in trees]

    def _advance(self, r: Request, reply=None) -> None:
        """Run r's generation up to its next base step or tree size (or its end)."""
        try:
            while True:
                if r.abandoned and not r.decoder.finish_reason:
                    r.decoder.finish("cancelled")
                item = r.steps.send(reply)
                reply = None
                if isinstance(item, (Rows, TreeSize)):
                    r.pending = item
                    return
                r.tokens.put(item)
        except StopIteration:
            self._end(r, FINISHED)
        except Exception as e:  # this generation's fault only
            self._end(r, e)

    def _end(self, r: Request, last) -> None:
        """r leaves, and its reader gets `last`, whatever freeing its slot raises (raised after)."""
        try:
            r.pending = None
            if r.steps is not None:
                r.steps.close()
            self.engine.close_sequence(r.decoder.seq)
            self.engine.fit()  # the next steps read no more cache than the open sequences need
        finally:
            with self._lock:
                if r in self._active:
                    self._active.remove(r)
            r.tokens.put(last)
