"""What a step of each graph costs on this machine, by rows and context: the table EAGLE-2's trees are
sized by (eagle2/sizing.py). Measured by a short probe the first time an artifact is loaded on a
machine (a few seconds; fewer sizes, one step each, where a step is slow) and kept in
ARTIFACT/tuning.json for that machine and thread count, so that every later load sizes its trees
from the same numbers; `runtime tune` measures it again, with more steps a size.

The probe runs steps over the caches as they are (their contents do not change a step's time) at
two contexts; a step's cost is taken as linear in the context between and beyond them, which is
how the attention over the cache grows.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

from eagle2 import tree_from_parents
from models.cpu import cpu_name

from .engine import Engine
from .tuning import TUNING_FILE, read_tuning, write_tuning

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
FEW_ROWS = (1, 2, 4, 8, 16, 32)   # where a step is slow (large models): fewer sizes, one step each
SLOW_STEP_S = 0.1
DRAFT_ROWS = (1, 2, 4, 8, 16)
CONTEXTS = (64, 1024)
log = logging.getLogger("runtime")


@dataclass(frozen=True)
class StepCosts:
    """Seconds per step: verify[c][i] with `rows[i]` rows at contexts[c], draft[c][j] the head's step
    with draft_rows[j] rows."""
    machine: str
    threads: int
    contexts: tuple[int, int]
    rows: tuple[int, ...]
    verify: tuple[tuple[float, ...], tuple[float, ...]]
    draft_rows: tuple[int, ...]
    draft: tuple[tuple[float, ...], tuple[float, ...]]

    @staticmethod
    def _rising(table) -> tuple[np.ndarray, np.ndarray]:
        """A step of more rows never costs less than one of fewer: where one was measured cheaper, the
        fewer rows' figure caught a slow moment of the machine, so each size takes the least of its own
        and every larger size's."""
        return tuple(np.minimum.accumulate(np.asarray(t, dtype=np.float64)[::-1])[::-1] for t in table)

    # The tables the sizing reads, made rising once per table rather than at every cycle's sizing.
    @cached_property
    def _verify_rising(self) -> tuple[np.ndarray, np.ndarray]:
        return self._rising(self.verify)

    @cached_property
    def _draft_rising(self) -> tuple[np.ndarray, np.ndarray]:
        return self._rising(self.draft)

    @staticmethod
    def _at(grid, table, contexts, rows: np.ndarray, context: int) -> np.ndarray:
        low, high = (np.interp(rows, grid, t, right=np.nan) for t in table)
        # Past the grid's largest step, the cost of its last rows goes on growing at their rate.
        for values, t in ((low, table[0]), (high, table[1])):
            slope = (t[-1] - t[-2]) / (grid[-1] - grid[-2])
            past = np.isnan(values)
            values[past] = t[-1] + slope * (rows[past] - grid[-1])
        share = (context - contexts[0]) / (contexts[1] - contexts[0])
        return np.maximum(low + share * (high - low), 0.0)

    def verify_seconds(self, max_rows: int, context: int, generations: int = 1) -> np.ndarray:
        """[max_rows]: a verify step of 1..max_rows rows at `context` cached positions. With `generations`
        decoding side by side, one generation's share of a step in which each of them has as many rows:
        under load a tree's rows cost the step's rate per row, and its fixed cost is shared."""
        rows = generations * np.arange(1, max_rows + 1, dtype=np.float64)
        return self._at(self.rows, self._verify_rising, self.contexts, rows, context) / generations

    def draft_seconds(self, rows: int, context: int, generations: int = 1) -> float:
        """The head's step with `rows` rows (each generation's share, as verify_seconds)."""
        total = np.array([float(rows * generations)])
        return float(self._at(self.draft_rows, self._draft_rising, self.contexts, total, context)[0]) / generations

    def describe(self) -> str:
        one = self.verify_seconds(1, self.contexts[0])[0]
        return (f"step costs for {self.machine}, {self.threads} threads: a one-row step {1e3 * one:.1f} ms at "
                f"{self.contexts[0]} positions")


def _signature(engine: Engine) -> tuple[str, int]:
    return cpu_name(), engine.threads or os.cpu_count() or 1


def _time(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _tokens(engine: Engine, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) % engine.manifest["model"]["config"]["vocab_size"]


def verify_step_seconds(engine: Engine, seq, rows: int, context: int) -> float:
    """A verify step of a chain of `rows` tokens at `context` (a chain: the cost depends on the rows only)."""
    tree = tree_from_parents(_tokens(engine, rows), np.arange(rows) - 1)
    return _time(lambda: engine.run([engine.verify_rows(tree, context, seq)]))


def draft_step_seconds(engine: Engine, seq, rows: int, context: int) -> float:
    """A head step expanding `rows` nodes at `context`."""
    features = engine.base.device_array(np.zeros((rows, engine.hidden_size), engine.io_dtype))
    return _time(lambda: engine.run([engine.draft_expand_rows(_tokens(engine, rows), features,
                                                              np.ones((rows, rows), bool), context, 0, rows, seq)]))


def probe(engine: Engine, reps: int = 5) -> StepCosts:
    """Time verify and draft steps at CONTEXTS (the second cut to this engine's max_length), over the
    solo sequence's caches before any generation (a later one overwrites what the steps wrote)."""
    machine, threads = _signature(engine)
    top = max(engine.max_length - max(ROWS) - 1, 2)  # two distinct contexts, however short the cache
    contexts = (min(CONTEXTS[0], top // 2), min(CONTEXTS[1], top))
    seq = engine.solo
    log.info("measuring this machine's step costs for sizing trees (once: kept in %s)", TUNING_FILE)

    def at(context: int, measure, sizes, reps: int) -> tuple[float, ...]:
        # The caches held just above the context, growing with the rows as a generation's would.
        for session in (engine.base, engine.draft):
            session.reserve(context + 1, shrink=True)
        # The fastest of `reps` steps a size (a size's first step may also re-lay the caches out), the
        # sizes taken in turn, so that a slow moment on a shared machine lands on one step of several
        # sizes rather than on every step of one.
        best = [measure(engine, seq, r, context) for r in sizes]
        for _ in range(reps - 1):
            best = [min(b, measure(engine, seq, r, context)) for b, r in zip(best, sizes)]
        return tuple(best)

    try:
        rows = ROWS
        if at(contexts[0], verify_step_seconds, (1,), 1)[0] > SLOW_STEP_S:
            rows, reps = FEW_ROWS, 1
        verify = tuple(at(c, verify_step_seconds, rows, reps) for c in contexts)
        draft = tuple(at(c, draft_step_seconds, DRAFT_ROWS, reps) for c in contexts)
    finally:
        seq.end = 0
        for session in (engine.base, engine.draft):
            session.reserve(1, shrink=True)
    return StepCosts(machine, threads, contexts, rows, verify, DRAFT_ROWS, draft)


def load_or_probe(artifact, provider: str, engine: Engine, fresh: bool = False, reps: int = 5) -> StepCosts:
    """This machine's table for the artifact: the one kept in tuning.json, else (or with `fresh`) a new
    probe of `reps` steps a size, kept there (where the artifact's directory cannot be written, used
    for this load only, said)."""
    machine, threads = _signature(engine)
    kept = [c for c in (read_tuning(artifact, provider) or {}).get("step_costs", [])
            if (c["machine"], c["threads"]) == (machine, threads)]
    if kept and not fresh:
        c = kept[0]
        return StepCosts(c["machine"], c["threads"], tuple(c["contexts"]), tuple(c["rows"]),
                         tuple(map(tuple, c["verify"])), tuple(c["draft_rows"]), tuple(map(tuple, c["draft"])))
    costs = probe(engine, reps)
    others = [c for c in (read_tuning(artifact, provider) or {}).get("step_costs", [])
              if (c["machine"], c["threads"]) != (machine, threads)]
    try:
        write_tuning(artifact, provider, step_costs=others + [asdict(costs)])
    except OSError as e:
        log.warning("step costs measured for this load only: %s", e)
    return costs
