"""How big a tree pays: EAGLE-2's rerank orders a round's candidates by the product of their draft
probabilities along the path, which is the chance the draft gives each of being accepted. The sum
of those over a tree's nodes, scaled by how well the draft's chances came true so far in this
generation, is the tree's expected accepted length; a tree is worth its size where that per second
of the cycle (draft and verify step, from a per-machine cost table) is highest, and speculation is
worth its draft where the best tree still yields more per second than a plain step does.

Pure functions over arrays and a small per-generation state: the same scores, costs and history
give the same sizes, so a run repeats its trees exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# How fast the per-generation estimates follow the latest cycles (the weight of the newest one).
EMA_WEIGHT = 0.25
# What a lookup branch is taken to land before any has been verified in the generation.
LOOKUP_PRIOR = 2.0
# After drafting stopped paying: plain cycles before the next try, doubling while it keeps not
# paying, up to the longest wait.
FIRST_WAIT, LONGEST_WAIT = 2, 16
# What drafting pays is averaged over about this many drafted cycles (the newest one's weight is its
# inverse): a cycle lands one token or several, so a few unlucky ones in a row must not stop
# drafting that pays on average (docs/design.md).
PAYING_CYCLES = 8
# Before any cycle of the generation: drafting taken to yield this many times a plain step's tokens
# per second, what the default trees do on the CPUs measured, so that the first cycles are judged
# against a fair expectation rather than against break-even.
PAYING_PRIOR = 1.2


def expected_tokens(scores, calibration: float = 1.0) -> np.ndarray:
    """E[tokens a cycle yields] for trees of 1, 2, ... len(scores) + 1 nodes (root included), each
    holding the best candidates: the bonus token plus the calibrated sum of the kept nodes' path
    probabilities. scores: cumulative draft log-probabilities (DraftPool.scores[:size])."""
    best = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    return 1.0 + calibration * np.concatenate(([0.0], np.cumsum(np.exp(best))))


def best_tree_size(scores, step_seconds, fixed_seconds: float, calibration: float = 1.0,
                   extra_tokens: float = 0.0) -> int:
    """The tree size (root included, 1..len(step_seconds)) with the most expected tokens per second.
    step_seconds[m - 1]: the verify step's cost with m rows; fixed_seconds: what the cycle costs
    whatever its size (the draft's steps); extra_tokens: what rows verified beside the tree are
    expected to add (a lookup branch, whose rows step_seconds already counts)."""
    steps = np.asarray(step_seconds, dtype=np.float64)
    gain = expected_tokens(scores, calibration)[:len(steps)] + extra_tokens
    rate = gain / (fixed_seconds + steps[:len(gain)])
    return int(np.argmax(rate)) + 1  # the first of equals: the smaller tree


@dataclass
class Pace:
    """One generation's record of what its drafts and lookup branches landed, against what plain steps
    would have: when to draft, and whether a lookup branch is worth its rows. Every update is a
    function of the cycles' accepted nodes and the cost table only."""
    calibration: float = 1.0   # accepted tree nodes / the tree's expected nodes, averaged
    lookup_gain: float = LOOKUP_PRIOR  # nodes a lookup branch lands (would land) beyond the tree, averaged
    # A drafted cycle's tokens and its cost in plain steps (by the cost table), averaged; None before
    # the first.
    drafted_tokens: float | None = None
    drafted_steps: float | None = None
    plain_left: int = 0        # plain cycles to run before drafting again
    wait: int = FIRST_WAIT
    # Lookup branches offered and not yet settled: (the sequence index of their first token, their
    # tokens, the nodes the cycle's tree landed itself).
    offers: list = field(default_factory=list)

    def speculate(self) -> bool:
        """Whether this cycle drafts (asked once a cycle)."""
        if self.plain_left > 0:
            self.plain_left -= 1
            return False
        return True

    def lookup_pays(self, tokens: float, seconds_with: float, seconds_without: float) -> bool:
        """Whether a lookup branch's rows are worth what it is expected to land beside a cycle expected
        to yield `tokens`, at the cycle's costs with and without its rows."""
        return (tokens + self.lookup_gain) / seconds_with >= tokens / seconds_without

    def offered(self, at: int, chain, own: int) -> None:
        """A lookup branch was proposed for the tokens from sequence index `at`, grafted or not, in a
        cycle whose tree landed `own` nodes itself: what it would have landed is settled by the tokens
        that come (settle), so a branch left out still teaches whether branches pay."""
        if len(chain):
            self.offers.append((at, list(chain), own))

    def settle(self, sequence: list) -> None:
        """Settle the offers whose outcome the tokens so far decide: a branch lands the tokens it shares
        with what the sequence became, beyond what its cycle's tree landed."""
        open_ = []
        for at, chain, own in self.offers:
            came = sequence[at:at + len(chain)]
            match = next((i for i, (a, b) in enumerate(zip(chain, came)) if a != b), len(came))
            if match == len(came) and len(came) < len(chain):
                open_.append((at, chain, own))
                continue
            self.lookup_gain += EMA_WEIGHT * (max(match - own, 0) - self.lookup_gain)
        self.offers = open_

    @property
    def drafting(self) -> float:
        """Tokens per second of drafted cycles against a plain step's, as averaged so far."""
        if self.drafted_steps is None:
            return PAYING_PRIOR
        return self.drafted_tokens / self.drafted_steps

    def drafted(self, expected_nodes: float, accepted_nodes: int, tokens: int, plain_steps: float) -> None:
        """After a drafted cycle: the tree's expected nodes (without the root), how many of its own
        were accepted, the tokens the cycle yielded and what it cost in plain steps. Tokens and costs
        are averaged apart, so that their ratio is tokens over time, as a throughput is; where
        drafting has been slower, wait before drafting again, twice as long each time in a row."""
        if expected_nodes > 0:
            self.calibration += EMA_WEIGHT * (min(accepted_nodes / expected_nodes, 4.0) - self.calibration)
        if self.drafted_steps is None:
            self.drafted_tokens, self.drafted_steps = PAYING_PRIOR * plain_steps, plain_steps
        self.drafted_tokens += (tokens - self.drafted_tokens) / PAYING_CYCLES
        self.drafted_steps += (plain_steps - self.drafted_steps) / PAYING_CYCLES
        if self.drafting >= 1:
            self.wait = FIRST_WAIT
            return
        self.plain_left = self.wait
        self.wait = min(2 * self.wait, LONGEST_WAIT)
