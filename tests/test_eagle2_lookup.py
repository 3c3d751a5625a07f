"""Prompt lookup: the n-gram index and grafting its proposal onto a draft tree."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle2 import NgramIndex, graft_chain, tree_from_parents


def index(tokens, n=2):
    idx = NgramIndex(n, capacity=64)
    idx.extend(tokens)
    return idx


def naive_propose(tokens, n, length):
    """The continuation of the latest earlier occurrence of the last n tokens, by scanning back."""
    if len(tokens) < n:
        return []
    tail = tokens[-n:]
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start:start + n] == tail:
            return tokens[start + n:start + n + length]
    return []


def test_proposes_what_followed_the_latest_occurrence():
    #               the 2-gram (1, 2) occurs at 0 (then 3) and at 4 (then 7); it is also the tail
    idx = index([1, 2, 3, 9, 1, 2, 7, 8, 1, 2])
    assert idx.propose(3) == [7, 8, 1]
    assert idx.propose(1) == [7]


def test_the_proposal_stops_at_the_end_of_the_sequence():
    idx = index([5, 6, 5, 6])
    assert idx.propose(10) == [5, 6]


def test_no_proposal_without_an_earlier_occurrence():
    assert index([1, 2, 3, 4]).propose(4) == []
    assert index([1]).propose(4) == []
    assert index([1, 2, 1, 2]).propose(0) == []


def test_extending_in_pieces_equals_extending_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1]
    whole, pieces = index(tokens, 2), NgramIndex(2, capacity=len(tokens))
    for chunk in (tokens[:1], tokens[1:6], np.array(tokens[6:7]), tokens[7:]):
        pieces.extend(chunk)
    assert pieces.tokens.tolist() == whole.tokens.tolist() == tokens
    assert pieces.propose(5) == whole.propose(5) == [5, 9, 2, 6, 5]


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "3"])
def test_bad_ngram_sizes_are_refused(n):
    with pytest.raises(ValueError, match="n-gram"):
        NgramIndex(n, capacity=8)


def test_extending_past_the_capacity_is_refused():
    idx = NgramIndex(2, capacity=4)
    idx.extend([1, 2, 3])
    with pytest.raises(ValueError, match="capacity of 4"):
        idx.extend([4, 5])
    assert idx.tokens.tolist() == [1, 2, 3]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 4), st.integers(0, 6))
def test_matches_a_backward_scan(tokens, n, length):
    assert index(tokens, n).propose(length) == naive_propose(tokens, n, length)


# root 10 with children 11 and 12; 11 has child 13
TREE = tree_from_parents([10, 11, 12, 13], [-1, 0, 0, 1], np.array([0.0, -0.1, -0.5, -0.3]))


def path_tokens(tree, node):
    out = []
    while node > 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return out[::-1]


def test_graft_shares_the_nodes_the_tree_has():
    grafted = graft_chain(TREE, [11, 13, 20, 21], max_tokens=16)
    assert grafted.tokens.tolist() == [10, 11, 12, 13, 20, 21]
    assert grafted.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    assert grafted.scores.tolist() == [0.0, -0.1, -0.5, -0.3, -0.3, -0.3]  # a new node takes its parent's score
    assert path_tokens(grafted, 5) == [11, 13, 20, 21]


def test_graft_branches_where_the_chain_leaves_the_tree():
    grafted = graft_chain(TREE, [11, 14], max_tokens=16)
    assert grafted.tokens.tolist() == [10, 11, 12, 13, 14]
    assert grafted.parents.tolist() == [-1, 0, 0, 1, 1]
    assert grafted.depths.tolist() == [0, 1, 1, 2, 2]


def test_graft_is_cut_at_max_tokens():
    grafted = graft_chain(TREE, [12, 30, 31, 32], max_tokens=6)
    assert grafted.tokens.tolist() == [10, 11, 12, 13, 30, 31]
    assert graft_chain(TREE, [12, 30], max_tokens=4) is TREE


def test_a_chain_the_tree_holds_leaves_it_unchanged():
    assert graft_chain(TREE, [11, 13], max_tokens=16) is TREE
    assert graft_chain(TREE, [], max_tokens=16) is TREE


@st.composite
def trees_and_chains(draw):
    size = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
    tokens = [draw(st.integers(0, 5)) for _ in range(size)]
    for node in range(1, size):  # siblings distinct, as the draft pool makes them
        siblings = {tokens[c] for c in range(1, node) if parents[c] == parents[node]}
        while tokens[node] in siblings:
            tokens[node] += 1
    chain = draw(st.lists(st.integers(0, 5), max_size=8))
    return tree_from_parents(tokens, parents), chain, draw(st.integers(size, size + 10))


@settings(max_examples=300, deadline=None)
@given(trees_and_chains())
def test_graft_properties(case):
    tree, chain, max_tokens = case
    grafted = graft_chain(tree, chain, max_tokens)
    n = len(tree.tokens)
    assert len(grafted.tokens) <= max_tokens
    # the original tree is a prefix, unchanged
    assert grafted.tokens[:n].tolist() == tree.tokens.tolist()
    assert grafted.parents[:n].tolist() == tree.parents.tolist()
    # siblings stay distinct, so no candidate is verified twice
    for node in range(len(grafted.tokens)):
        kids = grafted.tokens[grafted.children(node)].tolist()
        assert len(kids) == len(set(kids))
    # the longest prefix of the chain the budget allows is a root-to-node path
    paths = {tuple(path_tokens(grafted, node)) for node in range(len(grafted.tokens))}
    held = 0
    while held < len(chain) and tuple(chain[:held + 1]) in paths:
        held += 1
    assert held == len(chain) or len(grafted.tokens) == max_tokens
