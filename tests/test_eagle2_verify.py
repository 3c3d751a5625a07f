"""Acceptance: greedy matching and lossless tree speculative sampling."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle2.sampling import process_logits, sample
from eagle2.tree import DraftPool, tree_from_parents
from eagle2.verify import accept_greedy, accept_sampling

#        0 (50)
#      /      \
#   1 (51)   2 (52)
#   /   \       \
# 3 (53) 4 (54)  5 (55)
#   |
# 6 (56)
HAND_TREE = tree_from_parents([50, 51, 52, 53, 54, 55, 56], [-1, 0, 0, 1, 1, 2, 3])


@pytest.mark.parametrize(
    "target_argmax, accepted, bonus",
    [
        ([51, 53, 9, 56, 9, 9, 77], [0, 1, 3, 6], 77),  # whole deepest path, bonus after the leaf
        ([52, 9, 55, 9, 9, 60, 9], [0, 2, 5], 60),
        ([51, 54, 9, 9, 61, 9, 9], [0, 1, 4], 61),
        ([51, 99, 9, 9, 9, 9, 9], [0, 1], 99),  # stops when no child matches
        ([40, 51, 52, 53, 54, 55, 56], [0], 40),  # nothing accepted: bonus is the root's argmax
    ],
)
def test_accept_greedy_hand_built(target_argmax, accepted, bonus):
    got, got_bonus = accept_greedy(HAND_TREE, np.array(target_argmax))
    np.testing.assert_array_equal(got, accepted)
    assert got.dtype == np.int64 and got_bonus == bonus


def test_accept_greedy_duplicate_siblings_take_first():
    tree = tree_from_parents([0, 5, 5, 6], [-1, 0, 0, 2])
    accepted, bonus = accept_greedy(tree, np.array([5, 1, 6, 2]))
    np.testing.assert_array_equal(accepted, [0, 1])
    assert bonus == 1


def test_accept_greedy_root_only():
    accepted, bonus = accept_greedy(tree_from_parents([3], [-1]), np.array([4]))
    np.testing.assert_array_equal(accepted, [0])
    assert bonus == 4


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4), st.integers(0, 4), st.integers(1, 40), st.integers(0, 2**32 - 1)
)
def test_accept_greedy_follows_true_continuation(k, depth, total_tokens, seed):
    """target_argmax comes from a "true" continuation; greedy must accept exactly its longest tree prefix."""
    vocab = max(k, 4)  # small vocabulary: partial matches are common
    rng = np.random.default_rng(seed)
    pool = DraftPool(top_k=k, depth=depth)
    ids = rng.random((1 + depth, k, vocab)).argsort(axis=2)[:, :, :k]
    logp = -np.sort(rng.exponential(size=(1 + depth, k, k)), axis=2)
    pool.reset(0, ids[0, 0], logp[0, 0])
    for step in range(depth):
        pool.expand(ids[step + 1], logp[step + 1])
    tree = pool.select(total_tokens)

    def path_tokens(node):
        tokens = []
        while node > 0:
            tokens.append(int(tree.tokens[node]))
            node = tree.parents[node]
        return tokens[::-1]

    # continuation: the path to a random node (so matches happen), then random tokens
    prefix = path_tokens(rng.integers(tree.tokens.shape[0]))
    truth = prefix + rng.integers(0, vocab, size=depth + 3 - len(prefix)).tolist()
    target_argmax = rng.integers(0, vocab, size=tree.tokens.shape[0])
    matching = [i for i in range(tree.tokens.shape[0]) if path_tokens(i) == truth[: tree.depths[i]]]
    for i in matching:
        target_argmax[i] = truth[tree.depths[i]]
    longest = max(tree.depths[i] for i in matching)

    accepted, bonus = accept_greedy(tree, target_argmax)
    assert accepted[0] == 0 and len(accepted) == longest + 1
    assert tree.tokens[accepted[1:]].tolist() == truth[:longest]
    assert bonus == truth[longest]
    assert all(tree.parents[b] == a for a, b in zip(accepted, accepted[1:]))


def test_accept_sampling_deterministic_cases():
    rng = np.random.default_rng(0)
    probs = np.zeros((7, 60))
    probs[0, 52] = 1.0  # first child (51) must be rejected, second (52) accepted
    probs[2, 55] = 1.0
    probs[5, 33] = 1.0  # leaf: bonus drawn from the full row
    probs[[1, 3, 4, 6]] = 1.0 / 60
    before = probs.copy()
    for _ in range(20):
        accepted, bonus = accept_sampling(HAND_TREE, probs, rng)
        np.testing.assert_array_equal(accepted, [0, 2, 5])
        assert bonus == 33
    np.testing.assert_array_equal(probs, before)  # rows are copied, never modified


def test_accept_sampling_residual_is_renormalised():
    """All root mass is on the two children: one of them must always be accepted."""
    probs = np.full((7, 60), 1.0 / 60)
    probs[0] = 0.0
    probs[0, [51, 52]] = [0.7, 0.3]
    rng = np.random.default_rng(1)
    firsts = [accept_sampling(HAND_TREE, probs, rng)[0][1] for _ in range(300)]
    assert set(firsts) == {1, 2}


def test_accept_sampling_validation():
    with pytest.raises(ValueError):
        accept_sampling(HAND_TREE, np.ones((6, 60)), np.random.default_rng(0))
    with pytest.raises(ValueError):
        accept_greedy(HAND_TREE, np.zeros(6, dtype=np.int64))
    with pytest.raises(ValueError):
        accept_greedy(HAND_TREE, np.zeros(7))


# ---------------------------------------------------------------------------
# Statistical losslessness: tree drafting + accept_sampling must reproduce the
# base model's own distribution over the first two generated tokens.

V, ROOT, TOP_K, DEPTH, TOTAL_TOKENS = 8, 0, 3, 2, 10
DRAWS, ALPHA = 20_000, 1e-3
_tables = np.random.default_rng(2024)
BASE = _tables.normal(size=(V, V))  # toy bigram base model: next-token logits given the previous token
DRAFT = BASE + _tables.normal(size=(V, V))  # a related but different draft model

CONFIGS = {
    "t0.5": dict(temperature=0.5),
    "t1.0": dict(temperature=1.0),
    "top_p0.9": dict(temperature=1.0, top_p=0.9),
    "top_k3": dict(temperature=0.7, top_k=3),
}


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def draft_tree(root):
    """EAGLE-2 drafting with the toy draft: the tree for a given root is deterministic."""
    pool = DraftPool(top_k=TOP_K, depth=DEPTH)
    logp = log_softmax(DRAFT[root])
    ids = np.argsort(-logp, kind="stable")[:TOP_K]
    pool.reset(root, ids, logp[ids])
    for _ in range(DEPTH):
        logp = log_softmax(DRAFT[pool.frontier_tokens()])
        ids = np.argsort(-logp, axis=1, kind="stable")[:, :TOP_K]
        pool.expand(ids, np.take_along_axis(logp, ids, axis=1))
    return pool.select(TOTAL_TOKENS)


TREES = [draft_tree(root) for root in range(V)]


def first_two_tokens(accept, target_probs, rng):
    """Run verify cycles from ROOT until two tokens are generated; return them as one cell index."""
    generated, root = [], ROOT
    while len(generated) < 2:
        tree = TREES[root]
        accepted, root = accept(tree, target_probs[root], rng)
        generated += tree.tokens[accepted[1:]].tolist() + [root]
    return generated[0] * V + generated[1]


def chi_square_pvalue(observed, expected_probs):
    """Goodness of fit; a draw in a cell of exact probability 0 is an outright rejection."""
    from scipy.stats import chisquare

    if observed[expected_probs == 0].sum() > 0:
        return 0.0
    positive = expected_probs > 0
    observed, expected = observed[positive], expected_probs[positive] * observed.sum() / expected_probs[positive].sum()
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    return chisquare(observed[keep], expected[keep]).pvalue


def empirical_pvalue(config, accept=accept_sampling, verify_config=None, seed=0):
    """Sample DRAWS pairs with `accept`, compare with the exact base distribution under `config`.

    verify_config lets a broken pipeline verify against differently processed
    probabilities than the ones that define the target distribution.
    """
    processed = [process_logits(BASE[t], **config) for t in range(V)]
    exact = (processed[ROOT][:, None] * np.stack(processed)).ravel()  # P(x1) * P(x2 | x1)
    verify_config = verify_config or config
    target_probs = [process_logits(BASE[tree.tokens], **verify_config) for tree in TREES]
    rng = np.random.default_rng(seed)
    cells = [first_two_tokens(accept, target_probs, rng) for _ in range(DRAWS)]
    return chi_square_pvalue(np.bincount(cells, minlength=V * V), exact)


@pytest.mark.parametrize("name", CONFIGS)
def test_tree_sampling_matches_base_distribution(name):
    assert empirical_pvalue(CONFIGS[name]) > ALPHA


# Deliberately broken verifiers: the same statistical check must reject each of them.


def accept_without_rejection(tree, target_probs, rng):
    """Broken: takes the draft's first child whenever there is one."""
    accepted = [0]
    while len(tree.children(accepted[-1])):
        accepted.append(int(tree.children(accepted[-1])[0]))
    return np.array(accepted), sample(target_probs[accepted[-1]], rng)


def accept_without_renormalising(tree, target_probs, rng):
    """Broken: after a rejection, later siblings are tested against the unrenormalised p."""
    accepted = [0]
    while True:
        p = target_probs[accepted[-1]].copy()
        for child in tree.children(accepted[-1]):
            if rng.random() < p[tree.tokens[child]]:
                accepted.append(int(child))
                break
            p[tree.tokens[child]] = 0.0
        else:
            return np.array(accepted), sample(p, rng)


@pytest.mark.parametrize(
    "name, accept, verify_config",
    [
        ("t1.0", accept_without_rejection, None),
        ("t1.0", accept_without_renormalising, None),
        ("top_p0.9", accept_sampling, dict(temperature=1.0)),  # verification ignores top-p
    ],
    ids=["no_rejection", "no_renormalisation", "ignores_top_p"],
)
def test_statistical_check_rejects_broken_verifiers(name, accept, verify_config):
    assert empirical_pvalue(CONFIGS[name], accept, verify_config) < ALPHA
