"""The decoding loop: EAGLE-2 (draft a tree, verify it in one base forward, accept, compact)
and plain autoregressive decoding on the same graph and buffers, greedy or sampled.

Bookkeeping: `context` = tokens in the base KV cache; the *root* is the newest token, produced
by the last verification but not yet in the cache. Each cycle verifies [root + drafted nodes],
commits root + accepted nodes to the cache and produces the accepted nodes + one bonus token
(the next root): len(accepted) tokens, EAGLE's acceptance length tau.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from eagle2 import (DraftPool, NgramIndex, Pace, accept_greedy, accept_sampling, best_tree_size, expected_tokens,
                    graft_chain, process_logits, sample, token_logprobs, tree_from_parents)

from .engine import MAX_DEPTH, MAX_LOOKUP, MAX_TOP_K, MAX_TREE_TOKENS, PREFILL_CHUNK, Engine, Rows, Sequence
from .prefix_cache import Hit


# The lookup matches the last 3 committed tokens and proposes up to 8 tokens when neither the call
# nor the tuning names a length: the fastest branch length measured; matching fewer tokens (alone or
# as a fallback) accepts more but verifies more rows, for no clear gain (docs/code-notes.md).
LOOKUP_NGRAM = 3
DEFAULT_LOOKUP = 8
TREE_FIELDS = ("total_tokens", "depth", "top_k", "lookup")  # a tree's settings, in the order labels give them


def as_tree(settings: tuple[int, int, int, int]) -> dict:
    """(total, depth, top_k, lookup) -> the keyword arguments generate() takes for that tree."""
    return dict(zip(TREE_FIELDS, settings))


def tree_label(tree: dict) -> str:
    """total/depth/top_k, with +lookup when there is a lookup branch: 4/1/2+4."""
    lookup = tree.get("lookup", 0)
    return "{total_tokens}/{depth}/{top_k}".format(**tree) + (f"+{lookup}" if lookup else "")


MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class PromptTooLongError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 256
    speculative: bool = True
    total_tokens: int = 12
    depth: int = 4
    top_k: int = 4
    lookup: int = 0  # tokens of the prompt-lookup branch grafted onto each tree (0: none)
    temperature: float = 0.0
    top_p: float = 1.0
    sampling_top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # each token's log-probability and this many most likely ones (None: none)
    # Step costs (runtime/step_costs.StepCosts) to size each tree by, up to total_tokens, and to go on
    # plain steps while trees do not pay (eagle2/sizing.py); None: total_tokens every cycle.
    sizing: object = None

    @property
    def seeded_sampling(self) -> bool:
        """A seeded sampled reply draws what it draws alone only with the trees it has alone."""
        return self.temperature > 0 and self.seed is not None

    def check(self, engine: Engine) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.speculative and engine.draft is None:
            raise ValueError("this artifact has no draft head (exported with --no-head); use speculative=False")
        # depth 0: the tree is drawn from the root's draft children alone, one draft call a cycle.
        limits = (("total_tokens", self.total_tokens, 1, MAX_TREE_TOKENS), ("depth", self.depth, 0, MAX_DEPTH),
                  ("top_k", self.top_k, 1, MAX_TOP_K), ("lookup", self.lookup, 0, MAX_LOOKUP))
        for name, value, low, high in limits:
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")


@dataclass
class Stats:
    accept_lengths: list[int] = field(default_factory=list)
    new_tokens: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0         # prompt tokens whose caches came from the prefix cache
    start: float = field(default_factory=time.perf_counter)
    first_token_s: float = 0.0
    total_s: float = 0.0


class _Rows:
    """The verify logits each emitted token of a cycle was chosen from: its parent node's row."""

    def __init__(self, logits, accepted: np.ndarray):
        self.logits, self.accepted = logits, accepted

    def __getitem__(self, i: int):
        return self.logits[int(self.accepted[i])]


@dataclass(eq=False)
class TreeSize:
    """A drafted pool waiting for its tree's size: `wanted` nodes, root included, unless a scheduler
    sharing the step among several generations grants fewer (runtime/batch.py). `fixed` trees are
    granted what they want: a seeded sampled reply must draw what it draws alone."""
    scores: np.ndarray
    wanted: int
    lookup: int                        # rows the lookup branch may add to the tree
    fixed: bool


def check_request(engine: Engine, prompt, settings: Settings) -> None:
    """Refuse a generation that cannot run: bad settings, an empty prompt, one that leaves no room."""
    settings.check(engine)
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    if len(prompt) >= engine.max_length:
        raise PromptTooLongError(f"the prompt has {len(prompt)} tokens but max_length is {engine.max_length}: "
                                 "it must leave room for at least one new token")


class Decoder:
    """One generation over an Engine. Iterate `tokens()` for lists of new tokens; or `steps()`, which
    also yields each graph step it needs (Rows, run by the caller with others' rows: runtime/batch.py)
    and each tree's size before it goes on."""

    def __init__(self, engine: Engine, prompt: list[int], settings: Settings, stop_ids: set[int],
                 seq: Sequence | None = None, speculate=None, constraint=None, side_by_side=None):
        """speculate: asked before each cycle whether to draft a tree (a scheduler under load may
        find plain steps faster: runtime/batch.py); None, always. Either way greedy output is the
        same, and sampled output keeps its distribution. constraint: a grammar whose masks every row
        a token is chosen from gets (runtime/constraints.py), a tree's rows each after its own path."""
        check_request(engine, prompt, settings)
        self.engine, self.prompt, self.s, self.stop_ids = engine, np.asarray(prompt, np.int64), settings, stop_ids
        self.rng = np.random.default_rng(settings.seed)
        self.pool = DraftPool(settings.top_k, settings.depth) if settings.speculative else None
        # Room for a whole last cycle: its tokens are recorded even past the limit that ends the run.
        self.history = (NgramIndex(LOOKUP_NGRAM, engine.max_length + MAX_TREE_TOKENS)
                        if settings.speculative and settings.lookup else None)
        self.stats = Stats(prompt_tokens=len(prompt))
        self.finish_reason: str | None = None
        # The tokens so far (the newest, the root, not yet in the cache), and what the caches hold of
        # them at the last point they were consistent: (base positions, tokens the head's rows cover).
        self.sequence = list(self.prompt.tolist())
        self._kept: tuple[int, int] | None = None
        # With settings.logprobs: (log-probability, top ids, their log-probabilities) of each token emitted.
        self.logprobs: list[tuple[float, np.ndarray, np.ndarray]] = []
        self.seq = seq or engine.solo
        self.speculate = speculate or (lambda: True)
        # Generations sharing its steps (a scheduler's load), asked once a cycle: what the sizing's costs
        # are shared by.
        self.side_by_side = side_by_side or (lambda: 1)
        self._sharing = 1
        self.constraint = constraint
        if constraint is not None:  # a reply cut by the limit would not be whole JSON
            constraint.end_within(min(settings.max_new_tokens, engine.max_length - len(prompt)))
        self.pace = Pace() if settings.sizing is not None and settings.speculative else None
        # The tree verified next, where the pace sized it: (its size, its expected nodes, the draft's
        # seconds, None for a plain cycle's lookup branch).
        self._sized: tuple[int, float, float | None] | None = None
        self._offer: list = []  # the lookup branch proposed for the tree verified next, grafted or not
        if seq is None:
            engine.start(len(prompt))
            for key in engine.timings:
                engine.timings[key] = 0.0

    def _choose(self, logits: np.ndarray) -> int:
        if self.s.temperature == 0:
            return int(logits.argmax())
        return sample(process_logits(logits, self.s.temperature, self.s.sampling_top_k, self.s.top_p, self.s.min_p),
                      self.rng)

    def _accept(self, tree, logits):
        if self.s.temperature == 0:
            return accept_greedy(tree, logits[: len(tree.tokens)].argmax(-1))
        # Only the rows the walk visits are processed (top-p sorts the vocabulary).
        return accept_sampling(tree, lambda node: process_logits(
            logits[node], self.s.temperature, self.s.sampling_top_k, self.s.top_p, self.s.min_p), self.rng)

    def _reuse(self) -> Hit:
        """The prompt's stored prefix, copied into this sequence's caches (runtime/prefix_cache.py)."""
        if self.engine.prefix is None:
            return Hit()
        hit = self.engine.prefix.lookup(self.prompt)
        self.engine.restore_prefix(self.seq, hit)
        self.stats.prefix_hit_tokens = hit.tokens
        return hit

    def _prefill(self, first: int):
        """The prompt from position `first` on, in chunks; its last row's logits (valid until the next
        step), or None if the generation was ended while its prompt was filled."""
        e = self.engine
        for start in range(first, len(self.prompt), PREFILL_CHUNK):
            if self.finish_reason:
                return None
            part = e.prefill_rows(self.prompt[start:start + PREFILL_CHUNK], start, self.seq)
            yield part
            logits = e.finish_prefill(part)
        return logits

    def _draft_context(self, start: int, next_tokens: np.ndarray, prompt: bool = False):
        """Feed the head rows start.. ; return the root's draft row (hidden [1, H], top-k ids, log-probs)."""
        e = self.engine
        for i in range(0, len(next_tokens), PREFILL_CHUNK):
            part = e.draft_context_rows(next_tokens[i:i + PREFILL_CHUNK], start + i, self.s.top_k, self.seq, prompt)
            yield part
            hidden, ids, logp = e.finish_draft(part)
        return hidden[-1:], ids[0], logp[0]

    def _size(self, scores: np.ndarray, most: int, chain: list, context: int) -> tuple[int, list]:
        """The tree's size by this machine's step costs (eagle2/sizing.py), and the lookup branch to
        graft beside it (`chain`, or none where its rows do not pay)."""
        pace = self.pace
        steps = self.s.sizing.verify_seconds(most + len(chain), context, self._sharing)
        fixed = self._draft_seconds(context)
        size = best_tree_size(scores, steps[:most], fixed, pace.calibration)
        self._offer = chain
        if chain:
            with_chain = best_tree_size(scores, steps[len(chain):], fixed, pace.calibration, pace.lookup_gain)
            tokens = expected_tokens(scores, pace.calibration)[with_chain - 1]
            if pace.lookup_pays(tokens, fixed + steps[len(chain) + with_chain - 1], fixed + steps[with_chain - 1]):
                return with_chain, chain
        return size, []

    def _draft_seconds(self, context: int) -> float:
        """A drafted cycle's steps of the head (the context's and depth expansions), by the cost table."""
        return (self.s.depth + 1) * self.s.sizing.draft_seconds(self.s.top_k, context, self._sharing)

    def _lookup_tree(self, root: int, context: int, limit: int):
        """A cycle the pace keeps plain: the root, and the lookup branch where its rows pay."""
        tree = tree_from_parents([root], [-1])
        chain = self.history.propose(self.s.lookup) if self.history is not None else []
        if self.constraint is not None:
            chain = self.constraint.valid_prefix(chain)
        self._offer = chain
        if chain:
            steps = self.s.sizing.verify_seconds(1 + len(chain), context, self._sharing)
            if self.pace.lookup_pays(1.0, steps[-1], steps[0]):
                self._sized = (1, 0.0, None)
                return graft_chain(tree, chain, min(1 + len(chain), limit, MAX_TREE_TOKENS))
        return tree

    def _draft_tree(self, root: int, context: int, head, limit: int):
        """EAGLE-2 expand (depth draft calls) + rerank, plus the prompt-lookup branch.
        `head` = (hidden, ids, logp) of the root's draft row."""
        hidden, ids, logp = head
        pool, k = self.pool, self.s.top_k
        pool.reset(root, ids[:k], logp[:k])
        for step in range(self.s.depth):
            part = self.engine.draft_expand_rows(pool.frontier_tokens(), hidden[pool.frontier_parent_rows()],
                                                 pool.frontier_mask(), context, step, k, self.seq)
            yield part
            hidden, ids, logp = self.engine.finish_draft(part)
            pool.expand(ids, logp)
        chain = self.history.propose(self.s.lookup) if self.history is not None else []
        wanted = min(self.s.total_tokens, limit)
        if self.constraint is not None:  # candidates the grammar forbids give their rows to others
            ruled_out = ~self.constraint.valid_paths(pool.tokens[:pool.size], pool.parents[:pool.size])
            pool.scores[:pool.size][ruled_out] = -np.inf
            wanted = min(wanted, 1 + pool.size - int(ruled_out.sum()))
            chain = self.constraint.valid_prefix(chain)
        if self.pace is not None:
            wanted, chain = self._size(pool.scores[:pool.size], wanted, chain, context)
        size = yield TreeSize(pool.scores[:pool.size], wanted, self.s.lookup, self.s.seeded_sampling)
        tree = pool.select(size)
        if self.pace is not None:
            self._sized = (size, float(np.exp(tree.scores[1:]).sum()), self._draft_seconds(context))
        if self.history is None:
            return tree
        size = min(len(tree.tokens) + self.s.lookup, limit, MAX_TREE_TOKENS)
        return graft_chain(tree, chain, size)

    def tokens(self):
        """Yield lists of newly produced tokens until a stop token, max_new_tokens or max_length."""
        steps, reply = self.steps(), None
        try:
            while True:
                try:
                    item = steps.send(reply)
                except StopIteration:
                    return
                reply = None
                if isinstance(item, Rows):
                    self.engine.run([item])
                elif isinstance(item, TreeSize):
                    reply = item.wanted
                else:
                    yield item
        finally:
            steps.close()  # now, while the caller still holds the engine

    def steps(self):
        """Yield what this generation needs from its caller and the lists of tokens it produces, until
        a stop token, max_new_tokens or max_length: a step of the base or the draft (Rows: run it,
        then resume) and the size of each tree (TreeSize: send the size granted). Closed early, it
        ends there. A generation that ended (finish_reason set; not one whose step failed) leaves
        what its caches hold to the prefix cache."""
        try:
            yield from self._generate()
        finally:
            if self.finish_reason and self._kept and self.engine.prefix is not None:
                self.engine.keep_prefix(self.seq, self.sequence, *self._kept)

    def _generate(self):
        e, s = self.engine, self.s
        hit = self._reuse()
        logits = yield from self._prefill(hit.tokens)
        if logits is None:
            return
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        root = self._choose(logits)
        self._constrain([root])
        context = len(self.prompt)
        self.stats.first_token_s = time.perf_counter() - self.stats.start
        self.sequence.append(root)
        drafted = hit.draft_tokens
        self._kept = (context, drafted)
        if e.prefix is not None:  # now, for requests arriving meanwhile with the same start (n > 1 choices)
            e.keep_prefix(self.seq, self.sequence, context, drafted)
        yield from self._emit([root], [logits])
        if self.history is not None:
            self.history.extend(np.append(self.prompt, root))
        # The head reads position j's feature with token j + 1; it lags behind the cache while
        # cycles go without a tree, and catches up in one step when a tree is drafted again. A
        # reused prefix holds its rows below drafted - 1.
        first_unread = max(drafted - 1, 0)
        head, unread = None, (self.prompt[first_unread + 1:].tolist() + [root]) if s.speculative else []
        while not self.finish_reason:
            # The sequence is context + 1 tokens long; a cycle adds at most as many as it verifies.
            room = e.max_length - (context + 1)
            if room <= 0:
                self._finish("length")
                break
            limit = min(room, e.key_block - context % e.key_block)
            trees = s.speculative and limit > 1 and s.total_tokens > 1 and self.speculate()
            self._sharing = self.side_by_side()
            if trees and (self.pace is None or self.pace.speculate()):
                if unread:
                    start = context - len(unread)
                    head = yield from self._draft_context(start, np.asarray(unread, np.int64),
                                                          prompt=start == 0 or len(unread) > MAX_TOP_K)
                    unread = []
                    drafted = context + 1
                    self._kept = (context, drafted)
                tree = yield from self._draft_tree(root, context, head, limit)
            elif trees:
                tree = self._lookup_tree(root, context, limit)
            else:
                tree = tree_from_parents([root], [-1])
            part = e.verify_rows(tree, context, self.seq)
            yield part
            logits = e.finish_verify(part)
            if self.constraint is not None:
                logits = self.constraint.mask_tree(tree, logits)
            accepted, bonus = self._accept(tree, logits)
            e.commit(accepted, context, seq=self.seq)
            self.stats.accept_lengths.append(len(accepted))
            new = tree.tokens[accepted[1:]].tolist() + [bonus]
            self._constrain(new)
            self._paced(tree, accepted, context)
            self.sequence += new
            if self.pace is not None:
                self.pace.settle(self.sequence)
            self._kept = (context + len(accepted), drafted)
            yield from self._emit(new, _Rows(logits, accepted))
            if self.history is not None:
                self.history.extend(new)
            if s.speculative:
                unread += new
            context += len(accepted)
            root = bonus

    def _paced(self, tree, accepted: np.ndarray, context: int) -> None:
        """Tell the pace what the cycle landed (nodes below the sized tree's size are its own) and the
        lookup branch it was offered; a drafted cycle's tokens and its cost in plain steps (by the cost
        table)."""
        if self.pace is None:
            return
        size, expected, fixed = self._sized or (1, 0.0, None)
        own = int(np.count_nonzero(accepted[1:] < size))
        self.pace.offered(len(self.sequence), self._offer, own)
        self._sized, self._offer = None, []
        if fixed is not None:
            steps = self.s.sizing.verify_seconds(len(tree.tokens), context, self._sharing)
            self.pace.drafted(expected, own, len(accepted), (fixed + steps[-1]) / steps[0])

    def _constrain(self, tokens: list[int]) -> None:
        """The grammar consumes new tokens, up to the first stop token (which ends it)."""
        if self.constraint is None:
            return
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.stop_ids), len(tokens))
        self.constraint.consume(tokens[:end])

    def _emit(self, tokens: list[int], rows):
        """Yield the tokens trimmed to max_new_tokens and the first stop token, setting finish_reason;
        rows[i]: the logits token i was chosen from (for its log-probabilities)."""
        out = []
        for i, t in enumerate(tokens):
            if self.s.logprobs is not None:
                self.logprobs.append(token_logprobs(rows[i], t, self.s.logprobs))
            out.append(t)
            self.stats.new_tokens += 1
            if t in self.stop_ids:
                self._finish("stop")
                break
            if self.stats.new_tokens >= self.s.max_new_tokens:
                self._finish("length")
                break
        yield out

    def finish(self, reason: str) -> None:
        """End the generation early (a stop string, a cancelled request)."""
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        # Timed here, before the last tokens reach the caller, so a slow consumer is not counted.
        self.finish_reason = reason
        self.stats.total_s = time.perf_counter() - self.stats.start
