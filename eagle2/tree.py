"""EAGLE-2 dynamic draft tree: grow a candidate pool, then rerank it.

EAGLE-2 (arXiv 2406.16858) drafts a tree whose shape depends on the context:
each round the draft head expands only the `top_k` most promising nodes (by
cumulative draft log-probability, a proxy for acceptance probability), and at
the end the `total_tokens - 1` best nodes of the whole pool are verified.
Because log-probs are <= 0 a parent always scores >= its children, so the
reranked set is a connected tree rooted at the pending token.

Everything here is shape-static (capacity k + depth*k*k) so the runtime can
allocate once and reuse the pool across decoding rounds.
"""
from dataclasses import dataclass

import numpy as np


def _int_vector(name, values):
    array = np.asarray(values)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D integer array, got {array.dtype} {array.shape}")
    return array.astype(np.int64)


def _check_parents(parents):
    if parents.shape[0] < 1 or parents[0] != -1:
        raise ValueError("a tree needs a root: parents[0] must be -1")
    rest = parents[1:]
    if np.any((rest < 0) | (rest >= np.arange(1, parents.shape[0]))):
        raise ValueError("parents[i] must satisfy 0 <= parents[i] < i for every non-root node")


@dataclass(frozen=True)
class DraftTree:
    """The token tree the base model verifies in one forward pass.

    Parents precede their children (parents[i] < i; drafted nodes are breadth-first, grafted
    ones follow them). Node 0 is the root: the pending token that the previous verification
    produced and that is not yet in the KV cache. Arrays are made read-only so a tree can be
    shared freely.
    """

    tokens: np.ndarray  # int64 [T], tokens[0] = root
    parents: np.ndarray  # int64 [T], parents[0] = -1, parents[i] < i
    depths: np.ndarray  # int64 [T], depths[0] = 0
    scores: np.ndarray  # float64 [T], cumulative draft log-prob, scores[0] = 0

    def __post_init__(self):
        tokens = _int_vector("tokens", self.tokens)
        parents = _int_vector("parents", self.parents)
        depths = _int_vector("depths", self.depths)
        scores = np.asarray(self.scores, dtype=np.float64)
        if not tokens.shape == parents.shape == depths.shape == scores.shape:
            raise ValueError("tokens, parents, depths and scores must have the same length")
        _check_parents(parents)
        if depths[0] != 0 or np.any(depths[1:] != depths[parents[1:]] + 1):
            raise ValueError("depths must be 0 at the root and parent depth + 1 elsewhere")
        if scores[0] != 0:
            raise ValueError("the root's score must be 0")
        for name, array in (("tokens", tokens), ("parents", parents), ("depths", depths), ("scores", scores)):
            array.setflags(write=False)
            object.__setattr__(self, name, array)

    def children(self, node):
        """Children of `node` in tree order (= draft score order among siblings)."""
        return np.flatnonzero(self.parents == node)

    def attention_mask(self):
        """bool [T, T]: [i, j] is True iff j is i or an ancestor of i."""
        size = self.parents.shape[0]
        mask = np.eye(size, dtype=bool)
        rows = np.arange(size)
        ancestor = self.parents.copy()
        while True:  # one pass per tree level, vectorised over nodes
            live = ancestor >= 0
            if not live.any():
                return mask
            mask[rows[live], ancestor[live]] = True
            ancestor[live] = self.parents[ancestor[live]]

    def position_offsets(self):
        """Position of each node relative to the context length: its depth."""
        return self.depths

    def paths(self):
        """int64 [n_leaves, max_depth + 1]: root-to-leaf node indices, -1 padded."""
        is_leaf = np.ones(self.parents.shape[0], dtype=bool)
        is_leaf[self.parents[1:]] = False
        node = np.flatnonzero(is_leaf)
        paths = np.full((node.shape[0], int(self.depths.max()) + 1), -1, dtype=np.int64)
        rows = np.arange(node.shape[0])
        while True:
            live = node >= 0
            if not live.any():
                return paths
            paths[rows[live], self.depths[node[live]]] = node[live]
            node[live] = self.parents[node[live]]


def tree_from_parents(tokens, parents, scores=None):
    """Build a DraftTree from explicit (tokens, parents); depths are derived.

    Used for hand-written trees and for the runtime's plain fallback, e.g. a
    chain is tree_from_parents(tokens, np.arange(len(tokens)) - 1).
    """
    tokens = _int_vector("tokens", tokens)
    parents = _int_vector("parents", parents)
    if tokens.shape != parents.shape:
        raise ValueError("tokens and parents must have the same length")
    _check_parents(parents)
    depths = np.zeros_like(parents)
    for i in range(1, parents.shape[0]):  # parents[i] < i, so one forward pass suffices
        depths[i] = depths[parents[i]] + 1
    scores = np.zeros(parents.shape[0]) if scores is None else scores
    return DraftTree(tokens=tokens, parents=parents, depths=depths, scores=scores)


def graft_chain(tree, chain, max_tokens):
    """Add `chain` (tokens that would follow the root) to `tree` as one root-to-leaf path.

    The path reuses the nodes the tree already has (a sibling with the same token is the same
    candidate), so siblings stay distinct; new nodes are appended after the tree's own (parents
    still precede children) with their parent's score. The result has at most `max_tokens`
    nodes: the chain is cut where it would exceed that.
    """
    tokens, parents = list(tree.tokens), list(tree.parents)
    scores = list(tree.scores)
    node = 0
    for token in chain:
        children = tree.children(node) if node < len(tree.tokens) else ()
        same = [c for c in children if tree.tokens[c] == token]
        if same:
            node = int(same[0])
            continue
        if len(tokens) >= max_tokens:
            break
        tokens.append(int(token))
        parents.append(node)
        scores.append(scores[node])
        node = len(tokens) - 1
    if len(tokens) == len(tree.tokens):
        return tree
    return tree_from_parents(tokens, parents, np.asarray(scores))


def write_attention_bias(out, tree, context_length, masked_value):
    """Fill `out` [T, L + T] in place with the additive attention bias.

    Every tree node sees the whole committed context (columns [0, L)) plus
    itself and its ancestors; everything else gets `masked_value` (e.g.
    np.finfo(np.float32).min). Writing into the caller's buffer lets the
    runtime keep one preallocated bias tensor per shape.
    """
    size = tree.tokens.shape[0]
    if context_length < 0 or out.shape != (size, context_length + size):
        raise ValueError(f"out must have shape {(size, context_length + size)}, got {out.shape}")
    out[:, :context_length] = 0
    tree_columns = out[:, context_length:]
    tree_columns[...] = masked_value
    tree_columns[tree.attention_mask()] = 0


def _check_log_probs(name, log_probs, shape):
    log_probs = np.asarray(log_probs)
    if log_probs.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {log_probs.shape}")
    if not np.all(log_probs <= 0):  # also rejects NaN
        raise ValueError(f"{name} must be log-probabilities (<= 0); the tree stays connected only then")
    return log_probs


def _check_token_ids(name, token_ids, shape):
    token_ids = np.asarray(token_ids)
    if token_ids.shape != shape or token_ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array of shape {shape}, got {token_ids.dtype} {token_ids.shape}")
    return token_ids


class DraftPool:
    """Candidate pool for one draft round, preallocated for reuse.

    Pool layout: entries [0, k) are the root's children (depth 1); expansion
    step s appends k*k children at [k + s*k*k, k + (s+1)*k*k), row-major by
    frontier node, so pool index order is breadth-first. Only the first `size`
    entries are valid.

    Draft slots: the frontier fed to the draft head at step s occupies draft
    tree KV slots [s*k, (s+1)*k) (slot s*k + i for frontier node i); `slots`
    records that for expanded nodes and is -1 otherwise.
    """

    def __init__(self, top_k, depth):
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
        if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 0:
            raise ValueError(f"depth must be an integer >= 0, got {depth!r}")
        self.top_k, self.depth = int(top_k), int(depth)
        capacity = self.top_k + self.depth * self.top_k * self.top_k
        self.tokens = np.zeros(capacity, dtype=np.int64)
        self.parents = np.full(capacity, -1, dtype=np.int64)  # pool index, -1 = the root
        self.depths = np.zeros(capacity, dtype=np.int64)
        self.scores = np.zeros(capacity, dtype=np.float64)
        self.slots = np.full(capacity, -1, dtype=np.int64)
        self.frontier = np.arange(self.top_k, dtype=np.int64)  # pool indices
        self._frontier_rows = np.zeros(self.top_k, dtype=np.int64)
        self._tree_index = np.full(capacity, -1, dtype=np.int64)  # pool -> tree index, used by select
        self.root_token = 0
        self.step = 0
        self.size = 0

    def reset(self, root_token, child_ids, child_logp):
        """Start a round: the root's top-k draft children become frontier 0."""
        k = self.top_k
        child_ids = _check_token_ids("child_ids", child_ids, (k,))
        child_logp = _check_log_probs("child_logp", child_logp, (k,))
        self.root_token = int(root_token)
        self.tokens[:k] = child_ids
        self.parents[:k] = -1
        self.depths[:k] = 1
        self.scores[:k] = child_logp
        self.slots[:] = -1
        self.frontier = np.arange(k, dtype=np.int64)
        self._frontier_rows[:] = 0  # every root child is fed the root's hidden state
        self.step = 0
        self.size = k

    def frontier_tokens(self):
        """int64 [k]: tokens to feed the draft head at this step."""
        return self.tokens[self.frontier]

    def frontier_parent_rows(self):
        """int64 [k]: row of the previous draft call whose hidden state feeds each frontier node."""
        return self._frontier_rows.copy()

    def frontier_mask(self):
        """bool [k, (step+1)*k]: which draft tree slots each frontier node attends to.

        A node sees its own slot and the slots of its expanded ancestors (the
        root lives in the context KV, not in a tree slot).
        """
        k = self.top_k
        rows = np.arange(k)
        mask = np.zeros((k, (self.step + 1) * k), dtype=bool)
        mask[rows, self.step * k + rows] = True
        ancestor = self.parents[self.frontier]
        for _ in range(self.step):  # frontier nodes at step s have s non-root ancestors
            mask[rows, self.slots[ancestor]] = True
            ancestor = self.parents[ancestor]
        return mask

    def expand(self, child_ids, child_logp):
        """Add the draft's top-k children of every frontier node; keep the best k as the new frontier.

        child_ids, child_logp: [k, k], row i = children of frontier node i.
        Ties keep the earlier pool index (stable sort), making rounds reproducible.
        """
        if self.size == 0:
            raise RuntimeError("call reset() before expand()")
        if self.step >= self.depth:
            raise RuntimeError(f"the pool was sized for depth={self.depth} expansions")
        k = self.top_k
        child_ids = _check_token_ids("child_ids", child_ids, (k, k))
        child_logp = _check_log_probs("child_logp", child_logp, (k, k))
        self.slots[self.frontier] = self.step * k + np.arange(k)
        scores = (self.scores[self.frontier][:, None] + child_logp).ravel()
        start, stop = self.size, self.size + k * k
        self.tokens[start:stop] = child_ids.ravel()
        self.parents[start:stop] = np.repeat(self.frontier, k)
        self.depths[start:stop] = self.step + 2
        self.scores[start:stop] = scores
        best = np.argsort(-scores, kind="stable")[:k]
        self.frontier = start + best
        self._frontier_rows = best // k  # row i of this draft call produced frontier node i's children
        self.step += 1
        self.size = stop

    def select(self, total_tokens):
        """Rerank: keep the best total_tokens - 1 pool nodes, return them with the root as a DraftTree.

        Sorting by score with ties broken by pool index (which is breadth-first)
        keeps a parent ahead of its children even when a child's log-prob is 0,
        so the kept set is always connected.
        """
        if isinstance(total_tokens, bool) or not isinstance(total_tokens, (int, np.integer)) or total_tokens < 1:
            raise ValueError(f"total_tokens must be an integer >= 1, got {total_tokens!r}")
        count = min(int(total_tokens) - 1, self.size)
        kept = np.sort(np.argsort(-self.scores[: self.size], kind="stable")[:count])
        self._tree_index[: self.size] = -1
        self._tree_index[kept] = np.arange(1, count + 1)
        parent_pool = self.parents[kept]
        parents = np.where(parent_pool < 0, 0, self._tree_index[np.maximum(parent_pool, 0)])
        return DraftTree(
            tokens=np.concatenate(([self.root_token], self.tokens[kept])),
            parents=np.concatenate(([-1], parents)),
            depths=np.concatenate(([0], self.depths[kept])),
            scores=np.concatenate(([0.0], self.scores[kept])),
        )


def share_rows(scores, wanted, budget):
    """EAGLE-2's rerank across the trees that share one verify step.

    scores: one array per tree, the cumulative draft log-probabilities of its candidate nodes
    (DraftPool.scores[:size]); wanted: each tree's size alone, root included; budget: rows for all.
    Every tree keeps its root; the rows left go to the candidates of highest score over all trees,
    each tree taking at most wanted - 1 of its own. Returns the trees' sizes, root included; a tree's
    nodes are then its own best ones (DraftPool.select), as EAGLE-2 picks them for one tree.
    """
    if len(scores) != len(wanted):
        raise ValueError("one score array per tree")
    best = [np.sort(np.asarray(s, dtype=np.float64))[::-1][:max(int(w) - 1, 0)] for s, w in zip(scores, wanted)]
    spare = int(budget) - len(best)
    if spare >= sum(len(b) for b in best):
        return [1 + len(b) for b in best]
    if spare <= 0 or not best:
        return [1] * len(best)
    owner = np.repeat(np.arange(len(best)), [len(b) for b in best])
    kept = owner[np.argsort(-np.concatenate(best), kind="stable")[:spare]]
    return (1 + np.bincount(kept, minlength=len(best))).tolist()
