"""Logits processing (temperature / top-k / top-p) and categorical sampling."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle2.sampling import process_logits, sample


def reference_process(row, temperature, top_k, top_p):
    """Plain-Python restatement of the intended semantics, one row at a time."""
    x = [v / temperature for v in row]
    if top_k:
        kth = sorted(x, reverse=True)[min(top_k, len(x)) - 1]
        x = [v if v >= kth else -math.inf for v in x]
    if top_p < 1.0:
        m = max(x)
        weights = [math.exp(v - m) for v in x]
        p = [w / sum(weights) for w in weights]
        # most probable first; among equal logits the higher index counts as more probable
        order = sorted(range(len(x)), key=lambda i: (x[i], i), reverse=True)
        kept, mass = set(), 0.0
        for i in order:
            kept.add(i)
            mass += p[i]
            if mass >= top_p:
                break
        x = [v if i in kept else -math.inf for i, v in enumerate(x)]
    m = max(x)
    weights = [math.exp(v - m) for v in x]
    return [w / sum(weights) for w in weights]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 40),
    st.sampled_from([0.3, 0.7, 1.0, 1.9]),
    st.integers(0, 45),
    st.sampled_from([0.05, 0.5, 0.8, 0.95, 1.0]),
)
def test_process_logits_matches_reference(seed, vocab, temperature, top_k, top_p):
    logits = 3 * np.random.default_rng(seed).normal(size=(3, vocab))
    probs = process_logits(logits, temperature, top_k=top_k, top_p=top_p)
    assert probs.shape == logits.shape and probs.dtype == np.float64
    expected = [reference_process(row.tolist(), temperature, top_k, top_p) for row in logits]
    np.testing.assert_allclose(probs, expected, rtol=1e-12, atol=1e-15)


def test_top_k_keeps_ties_at_the_boundary():
    probs = process_logits(np.array([3.0, 1.0, 2.0, 2.0, 0.0]), 1.0, top_k=2)
    assert np.count_nonzero(probs) == 3  # the two tied second-best logits both survive
    assert probs[1] == probs[4] == 0


def test_top_p_boundary_and_ties():
    logits = np.log(np.array([0.25, 0.5, 0.25]))
    # mass 0.5 alone reaches top_p=0.5 exactly: a single token is kept
    np.testing.assert_allclose(process_logits(logits, 1.0, top_p=0.5), [0, 1, 0])
    # one of the tied 0.25s is needed: the higher index is kept (stable ascending sort drops index 0 first)
    np.testing.assert_allclose(process_logits(logits, 1.0, top_p=0.6), [0, 2 / 3, 1 / 3])
    # the most probable token always survives, even for a tiny top_p
    np.testing.assert_allclose(process_logits(logits, 1.0, top_p=1e-9), [0, 1, 0])


def test_process_logits_batched_and_masked_vocab():
    logits = np.random.default_rng(0).normal(size=(2, 3, 7))
    logits[..., 6] = -np.inf  # e.g. padded vocabulary entries
    probs = process_logits(logits, 0.8, top_k=4, top_p=0.9)
    assert probs.shape == (2, 3, 7)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0)
    assert np.all(probs[..., 6] == 0)
    np.testing.assert_allclose(probs[1, 2], process_logits(logits[1, 2], 0.8, top_k=4, top_p=0.9))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=-1.0),
        dict(temperature=np.inf),
        dict(temperature=1.0, top_k=-1),
        dict(temperature=1.0, top_k=2.5),
        dict(temperature=1.0, top_p=0.0),
        dict(temperature=1.0, top_p=1.5),
    ],
)
def test_process_logits_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        process_logits(np.zeros(4), **kwargs)


def test_process_logits_rejects_bad_logits():
    for logits in [np.zeros((2, 0)), np.array(1.0), np.array([0.0, np.nan]), np.array([-np.inf, -np.inf])]:
        with pytest.raises(ValueError):
            process_logits(logits, 1.0)


def test_matches_transformers_warpers():
    torch = pytest.importorskip("torch", reason="torch is needed for the transformers comparison")
    logits_process = pytest.importorskip(
        "transformers.generation.logits_process", reason="transformers is needed for the comparison"
    )
    rng = np.random.default_rng(7)
    # rounded logits tie at the top-k boundary; top-p cases stay tie-free (torch's sort order is unspecified)
    for temperature, top_k, top_p, min_p, rounded in [
        (1.0, 0, 0.9, 0.0, False),
        (0.6, 10, 1.0, 0.0, True),
        (1.3, 20, 0.8, 0.0, False),
        (0.7, 5, 0.5, 0.0, False),
        (1.0, 0, 0.3, 0.0, False),
        (1.0, 0, 1.0, 0.1, False),
        (0.8, 10, 0.9, 0.05, False),
    ]:
        logits = 2 * rng.normal(size=(16, 50))
        logits = np.round(logits) if rounded else logits
        scores = torch.from_numpy(logits)
        warpers = [logits_process.TemperatureLogitsWarper(float(temperature))]
        if top_k:
            warpers.append(logits_process.TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(logits_process.TopPLogitsWarper(top_p))
        if min_p > 0:
            warpers.append(logits_process.MinPLogitsWarper(min_p))
        for warper in warpers:
            scores = warper(None, scores)
        expected = torch.softmax(scores, dim=-1).numpy()
        probs = process_logits(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        np.testing.assert_allclose(probs, expected, rtol=1e-12, atol=1e-15)


def test_sample_distribution():
    from scipy.stats import chisquare

    probs = np.array([0.1, 0.0, 0.4, 0.2, 0.0, 0.3])
    rng = np.random.default_rng(3)
    draws = np.array([sample(probs * 7.0, rng) for _ in range(20_000)])  # normalisation is not required
    counts = np.bincount(draws, minlength=6)
    assert counts[1] == counts[4] == 0
    nonzero = probs > 0
    assert chisquare(counts[nonzero], 20_000 * probs[nonzero]).pvalue > 1e-3


def test_sample_rejects_bad_probs():
    rng = np.random.default_rng(0)
    for probs in [np.zeros(3), np.array([]), np.ones((2, 2)), np.array([np.nan, 1.0])]:
        with pytest.raises(ValueError):
            sample(probs, rng)
