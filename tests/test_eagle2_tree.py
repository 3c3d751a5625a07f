"""Draft tree: pool expansion, reranking, masks and paths."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle2.tree import DraftPool, tree_from_parents, write_attention_bias

VOCAB = 16


def draft_top_k(rng, rows, k, ties):
    """A seeded stand-in for the draft head: distinct top-k ids and sorted log-probs <= 0 per row.

    With `ties`, log-probs come from a coarse grid that includes 0, so equal
    scores (including parent == child) are common.
    """
    ids = rng.random((rows, VOCAB)).argsort(axis=1)[:, :k]
    if ties:
        logp = -0.5 * rng.integers(0, 3, size=(rows, k))
    else:
        logp = -rng.exponential(size=(rows, k))
    return ids, -np.sort(-logp, axis=1)


def naive_ancestors(parents, node):
    """Ancestors of `node` (excluding itself) by walking the parent pointers."""
    out = []
    while parents[node] >= 0:
        node = parents[node]
        out.append(node)
    return out


def naive_mask(parents):
    mask = np.zeros((len(parents), len(parents)), dtype=bool)
    for i in range(len(parents)):
        mask[i, [i] + naive_ancestors(parents, i)] = True
    return mask


def run_round(pool, rng, ties, root=0, check=None):
    ids, logp = draft_top_k(rng, 1, pool.top_k, ties)
    pool.reset(root, ids[0], logp[0])
    for _ in range(pool.depth):
        if check:
            check(pool)
        ids, logp = draft_top_k(rng, pool.top_k, pool.top_k, ties)
        pool.expand(ids, logp)


@st.composite
def pool_cases(draw):
    k = draw(st.integers(1, 4))
    depth = draw(st.integers(0, 4))
    total_tokens = draw(st.integers(1, k + depth * k * k + 3))
    return k, depth, total_tokens, draw(st.integers(0, 2**32 - 1)), draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(pool_cases())
def test_pool_round_invariants(case):
    k, depth, total_tokens, seed, ties = case
    rng = np.random.default_rng(seed)
    pool = DraftPool(top_k=k, depth=depth)
    previous_frontier = []

    def check_frontier(pool):
        step = pool.step
        np.testing.assert_array_equal(pool.frontier_tokens(), pool.tokens[pool.frontier])
        rows = pool.frontier_parent_rows()
        if step == 0:
            np.testing.assert_array_equal(rows, np.zeros(k))
        else:  # row i of the previous call was the previous frontier's node i
            np.testing.assert_array_equal(pool.parents[pool.frontier], previous_frontier[-1][rows])
            last = pool.scores[pool.size - k * k : pool.size]
            np.testing.assert_array_equal(np.sort(pool.scores[pool.frontier]), np.sort(last)[-k:])
        previous_frontier.append(pool.frontier.copy())
        mask = pool.frontier_mask()
        assert mask.shape == (k, (step + 1) * k)
        expected = np.zeros_like(mask)
        for i, node in enumerate(pool.frontier):
            expected[i, step * k + i] = True
            for ancestor in naive_ancestors(pool.parents, node):
                expected[i, pool.slots[ancestor]] = True
        np.testing.assert_array_equal(mask, expected)

    run_round(pool, rng, ties, root=7, check=check_frontier)
    assert pool.size == k + depth * k * k
    tree = pool.select(total_tokens)
    size = min(total_tokens, pool.size + 1)
    assert tree.tokens.shape == (size,) and tree.tokens[0] == 7 and tree.scores[0] == 0

    parents = tree.parents
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, size))
    np.testing.assert_array_equal(tree.attention_mask(), naive_mask(parents))
    np.testing.assert_array_equal(tree.position_offsets(), tree.depths)
    assert all(tree.depths[i] == tree.depths[parents[i]] + 1 for i in range(1, size))
    assert np.all(np.diff(tree.depths) >= 0)  # breadth-first
    for node in range(size):
        siblings = tree.tokens[tree.children(node)]
        assert len(set(siblings.tolist())) == len(siblings)
    best = np.sort(pool.scores[: pool.size])[::-1][: size - 1]
    np.testing.assert_array_equal(np.sort(tree.scores[1:])[::-1], best)


def test_pool_is_reusable_across_rounds():
    pool = DraftPool(top_k=3, depth=3)
    run_round(pool, np.random.default_rng(1), ties=False)
    run_round(pool, np.random.default_rng(2), ties=True, root=4)
    fresh = DraftPool(top_k=3, depth=3)
    run_round(fresh, np.random.default_rng(2), ties=True, root=4)
    np.testing.assert_array_equal(pool.frontier_mask(), fresh.frontier_mask())
    reused, expected = pool.select(12), fresh.select(12)
    for field in ("tokens", "parents", "depths", "scores"):
        np.testing.assert_array_equal(getattr(reused, field), getattr(expected, field))


def test_all_ties_keep_pool_order():
    """Zero log-probs make every score 0: ties go to shallower / earlier pool nodes."""
    pool = DraftPool(top_k=2, depth=2)
    pool.reset(9, [1, 2], [0.0, 0.0])
    pool.expand([[3, 4], [5, 6]], np.zeros((2, 2)))
    np.testing.assert_array_equal(pool.frontier_tokens(), [3, 4])
    np.testing.assert_array_equal(pool.frontier_parent_rows(), [0, 0])
    np.testing.assert_array_equal(pool.frontier_mask(), [[1, 0, 1, 0], [1, 0, 0, 1]])
    pool.expand([[7, 8], [10, 11]], np.zeros((2, 2)))
    tree = pool.select(6)
    np.testing.assert_array_equal(tree.tokens, [9, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 1, 1, 2])


def test_select_known_tree():
    pool = DraftPool(top_k=2, depth=1)
    pool.reset(0, [10, 20], np.log([0.6, 0.3]))
    np.testing.assert_array_equal(pool.frontier_mask(), np.eye(2, dtype=bool))
    pool.expand([[11, 12], [21, 22]], np.log([[0.9, 0.05], [0.5, 0.4]]))
    # pool scores: 10:.6 20:.3 | 11:.54 12:.03 21:.15 22:.12
    tree = pool.select(5)
    np.testing.assert_array_equal(tree.tokens, [0, 10, 20, 11, 21])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 1, 2])
    np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2, 2])
    np.testing.assert_allclose(np.exp(tree.scores), [1, 0.6, 0.3, 0.54, 0.15])
    np.testing.assert_array_equal(pool.select(1).tokens, [0])
    assert pool.select(100).tokens.shape == (7,)  # whole pool + root


def test_depth_zero_pool():
    pool = DraftPool(top_k=3, depth=0)
    pool.reset(5, [1, 2, 3], [-0.1, -0.2, -0.3])
    with pytest.raises(RuntimeError):
        pool.expand(np.zeros((3, 3), dtype=np.int64), np.zeros((3, 3)))
    np.testing.assert_array_equal(pool.select(3).tokens, [5, 1, 2])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=0, max_size=30), st.integers(0, 2**32 - 1))
def test_tree_from_random_parents(draws, seed):
    parents = np.array([-1] + [d % (i + 1) for i, d in enumerate(draws)])
    tokens = np.random.default_rng(seed).integers(0, VOCAB, size=parents.shape[0])
    tree = tree_from_parents(tokens, parents)
    np.testing.assert_array_equal(tree.attention_mask(), naive_mask(parents))
    depths = [len(naive_ancestors(parents, i)) for i in range(len(parents))]
    np.testing.assert_array_equal(tree.position_offsets(), depths)
    leaves = [i for i in range(len(parents)) if i not in set(parents[1:].tolist())]
    expected = np.full((len(leaves), max(depths) + 1), -1)
    for row, leaf in enumerate(leaves):
        path = naive_ancestors(parents, leaf)[::-1] + [leaf]
        expected[row, : len(path)] = path
    np.testing.assert_array_equal(tree.paths(), expected)


def test_hand_built_tree():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    tree = tree_from_parents([50, 51, 52, 53, 54, 55, 56], [-1, 0, 0, 1, 1, 2, 3])
    np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(tree.paths(), [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]])
    np.testing.assert_array_equal(tree.attention_mask()[6], [1, 1, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(tree_from_parents([7], [-1]).paths(), [[0]])


def test_write_attention_bias():
    tree = tree_from_parents([5, 6, 7, 8], [-1, 0, 0, 1])
    buffer = np.full((6, 10), 123.0, dtype=np.float32)
    view = buffer[1:5, :6]  # a strided view into a bigger preallocated buffer, L = 2
    write_attention_bias(view, tree, context_length=2, masked_value=-1e9)
    m = np.float32(-1e9)
    np.testing.assert_array_equal(
        view,
        [[0, 0, 0, m, m, m], [0, 0, 0, 0, m, m], [0, 0, 0, m, 0, m], [0, 0, 0, 0, m, 0]],
    )
    assert np.all(buffer[0] == 123) and np.all(buffer[:, 6:] == 123)  # nothing outside the view touched
    with pytest.raises(ValueError):
        write_attention_bias(np.zeros((4, 5), np.float32), tree, context_length=2, masked_value=-1e9)


def test_validation():
    for k, depth in [(0, 1), (-1, 1), (2, -1), (1.5, 1), (True, 1)]:
        with pytest.raises(ValueError):
            DraftPool(top_k=k, depth=depth)
    pool = DraftPool(top_k=2, depth=1)
    with pytest.raises(RuntimeError):
        pool.expand(np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2)))
    with pytest.raises(ValueError):
        pool.reset(0, [1, 2, 3], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        pool.reset(0, [1, 2], [0.0, 0.5])  # not a log-prob
    with pytest.raises(ValueError):
        pool.reset(0, [1.0, 2.0], [0.0, 0.0])
    pool.reset(0, [1, 2], [0.0, -1.0])
    with pytest.raises(ValueError):
        pool.expand(np.zeros((2, 3), dtype=np.int64), np.zeros((2, 3)))
    with pytest.raises(ValueError):
        pool.expand(np.zeros((2, 2), dtype=np.int64), np.full((2, 2), np.nan))
    for total_tokens in [0, -3, 2.0]:
        with pytest.raises(ValueError):
            pool.select(total_tokens)
    for tokens, parents in [([1, 2], [0, 0]), ([1, 2], [-1, 1]), ([1, 2], [-1, 5]), ([1], [-1, 0]), ([], [])]:
        with pytest.raises(ValueError):
            tree_from_parents(tokens, parents)


def test_share_rows_gives_each_tree_its_root_then_the_best_nodes_over_all():
    from eagle2 import share_rows
    a = np.log([0.9, 0.8, 0.1, 0.05])
    b = np.log([0.7, 0.2, 0.6])
    c = np.log([0.01])
    assert share_rows([a, b, c], [5, 4, 2], 100) == [5, 4, 2]          # room for every tree
    assert share_rows([a, b, c], [5, 4, 2], 3 + 4) == [3, 3, 1]        # 0.9 0.8 | 0.7 0.6
    assert share_rows([a, b, c], [3, 4, 2], 3 + 5) == [3, 4, 1]        # a wants only two: b gets 0.2
    assert share_rows([a, b, c], [5, 4, 2], 2) == [1, 1, 1]            # fewer rows than trees: roots only
    assert share_rows([], [], 10) == []
