"""Logits -> sampling distribution, shared by plain sampling and tree verification.

Speculative sampling is lossless only with respect to the distribution it is
handed, so plain decoding and tree verification must both go through
process_logits: any difference between the two paths would silently change
what the model generates.
"""
import numpy as np


def _softmax(x):
    shifted = x - x.max(axis=-1, keepdims=True)  # max is finite (checked), so no inf - inf
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def _check_args(temperature, top_k, top_p, min_p=0.0):
    if not (np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (greedy decoding is separate), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p!r}")
    if not (0 <= min_p <= 1):
        raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {min_p!r}")


def process_logits(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Turn logits [..., V] into sampling probabilities [..., V] (float64).

    Same order and semantics as transformers' generate() warpers:
    1. temperature: logits / temperature.
    2. top-k (TopKLogitsWarper): drop logits strictly below the k-th largest,
       so tokens tied with the k-th are all kept.
    3. top-p (TopPLogitsWarper): sort ascending, drop tokens whose ascending
       cumulative probability is <= 1 - top_p, never drop the most probable
       one. What remains is the smallest most-probable set with mass >= top_p.
       Tied logits are ordered by vocabulary index (stable sort: the lower
       index counts as less probable and is dropped first); torch.sort leaves
       that order unspecified, so only exact ties at the cut can differ.
    4. min-p (MinPLogitsWarper): drop tokens less probable than min_p times the
       most probable one.
    The result is a softmax over the surviving logits, computed in float64.
    """
    _check_args(temperature, top_k, top_p, min_p)
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {x.shape}")
    x = x / temperature
    if not np.all(np.isfinite(x.max(axis=-1))):
        raise ValueError("every row of logits / temperature needs a finite maximum (no NaN or +inf, not all -inf)")
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth_largest = np.partition(x, vocab - top_k, axis=-1)[..., vocab - top_k, None]
        x = np.where(x < kth_largest, -np.inf, x)
    probs = _softmax(x)
    if top_p < 1.0:
        drop = _top_p_drop_row(x, probs, top_p) if x.ndim == 1 else None
        if drop is None:
            drop = _top_p_drop(x, probs, top_p)
        x = np.where(drop, -np.inf, x)
        probs = _softmax(x)
    if min_p > 0:
        probs = _softmax(np.where(probs < min_p * probs.max(axis=-1, keepdims=True), -np.inf, x))
    return probs


def _top_p_drop(x, probs, top_p):
    order = np.argsort(x, axis=-1, kind="stable")
    cumulative = np.cumsum(np.take_along_axis(probs, order, axis=-1), axis=-1)
    drop_sorted = cumulative <= 1.0 - top_p
    drop_sorted[..., -1] = False
    drop = np.empty_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return drop


TOP_P_CANDIDATES = 1024


def _top_p_drop_row(x, probs, top_p):
    """The same decision as _top_p_drop for one row, sorting only the most probable candidates.

    A full sort of a 50k-150k vocabulary costs milliseconds per visited tree node. Let `above`
    be the tokens strictly more probable than the least probable of the top candidates. If their
    mass reaches top_p, every other token's ascending cumulative probability is <= 1 - top_p, so
    all of them are dropped and only `above` needs sorting. Otherwise returns None (full sort).
    """
    if x.shape[0] <= 4 * TOP_P_CANDIDATES:
        return None
    candidates = np.argpartition(x, -TOP_P_CANDIDATES)[-TOP_P_CANDIDATES:]
    above = candidates[x[candidates] > x[candidates].min()]
    mass = probs[above].sum()
    if mass < top_p:
        return None
    order = above[np.lexsort((above, x[above]))]  # ascending by logit, ties by index: as the stable sort
    cumulative = (1.0 - mass) + np.cumsum(probs[order])
    drop_sorted = cumulative <= 1.0 - top_p
    drop_sorted[-1] = False
    drop = np.ones(x.shape[0], dtype=bool)
    drop[order] = drop_sorted
    return drop


def sample(probs, rng):
    """Draw one token id from probs [V] (need not be normalised) with a numpy Generator.

    Inverse-CDF sampling; tokens with probability 0 are never returned.
    """
    probs = np.asarray(probs)
    if probs.ndim != 1 or probs.shape[0] == 0:
        raise ValueError(f"probs must have shape [V] with V >= 1, got {probs.shape}")
    cdf = np.cumsum(probs, dtype=np.float64)
    total = cdf[-1]
    if not (np.isfinite(total) and total > 0):
        raise ValueError(f"probs must have a finite positive sum, got {total}")
    token = int(np.searchsorted(cdf, rng.random() * total, side="right"))
    if token == probs.shape[0]:  # u * total rounded up to total: take the last token with mass
        token = int(np.flatnonzero(probs)[-1])
    return token


def token_logprobs(logits, token: int, top: int):
    """log p(token) under the model's distribution softmax(logits) [V] (float64), and the `top` most
    likely tokens with theirs, most likely first (ties: lower id first): OpenAI's logprobs."""
    x = np.asarray(logits, np.float64)
    m = x.max()
    log_z = m + np.log(np.exp(x - m).sum())
    best = np.empty(0, np.int64)
    if top:
        kth = -np.partition(-x, min(top, len(x)) - 1)[min(top, len(x)) - 1]
        above = np.flatnonzero(x > kth)
        best = np.concatenate([above, np.flatnonzero(x == kth)[:top - len(above)]])
        best = best[np.lexsort((best, -x[best]))]
    return float(x[token] - log_z), best, x[best] - log_z
