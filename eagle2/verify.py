"""Decide which drafted tokens the base model accepts after one tree forward pass.

Both functions walk down from the root and return (accepted, bonus_token):
- accepted: int64 tree node indices, root first. It always contains the root
  (node 0): the root is the previous cycle's bonus token, which is not yet in
  the KV cache, so this cycle commits tokens[accepted] to the cache.
- bonus_token: the base model's own next token after the last accepted node;
  it becomes the next cycle's root.
Accept length tau (tokens produced per verify cycle) = accepted drafted nodes
+ 1 bonus = len(accepted).
"""
import numpy as np

from .sampling import sample


def accept_greedy(tree, target_argmax):
    """Greedy verification: follow the child whose token is the base model's argmax.

    target_argmax [T]: base argmax after each tree node. Siblings normally have
    distinct tokens; if not, the first matching child (tree order) wins.
    """
    target_argmax = np.asarray(target_argmax)
    if target_argmax.shape != tree.tokens.shape or target_argmax.dtype.kind not in "iu":
        raise ValueError(f"target_argmax must be an integer array of shape {tree.tokens.shape}, got {target_argmax.dtype} {target_argmax.shape}")
    accepted = [0]
    while True:
        children = tree.children(accepted[-1])
        match = children[tree.tokens[children] == target_argmax[accepted[-1]]]
        if match.shape[0] == 0:
            return np.array(accepted, dtype=np.int64), int(target_argmax[accepted[-1]])
        accepted.append(int(match[0]))


def accept_sampling(tree, target_probs, rng):
    """Lossless speculative sampling over the tree (multi-draft, point-mass drafts).

    target_probs [T, V]: base distribution after each node, already processed
    by sampling.process_logits; or a function node -> [V] that computes it,
    so a caller with a large vocabulary processes only the rows the walk
    visits (top-p sorts the vocabulary). rng: numpy Generator. target_probs
    is not modified; only a copy of the current row is.

    At a node with distribution p, children x_1..x_m (distinct, the draft's
    deterministic top-k, so the draft "distribution" of each try is one-hot and
    the usual min(1, p/q) test accepts x_i with probability p(x_i)) are tried
    in order: accept x_i with probability p_i(x_i), where p_i is p with
    x_1..x_{i-1} removed and renormalised; on rejection remove x_i. If every
    child is rejected the bonus token is drawn from the residual p_{m+1}; at a
    leaf it is drawn from p itself.

    Why the next token is distributed exactly as p: let R_i = 1 - sum_{j<i}
    p(x_j), the probability that x_1..x_{i-1} were all rejected (induction).
    Then P(emit x_i) = R_i * p(x_i) / R_i = p(x_i), and all rejected happens
    with probability R_{m+1}, after which y (not a child) is drawn with
    probability p(y) / R_{m+1}, i.e. P(emit y) = p(y). Each try uses a fresh
    uniform, so this holds whatever the draft proposed. Having emitted a
    child, the walk continues with that child's row, which is the base
    distribution conditioned on the token just emitted; by induction over
    the depth, the emitted sequence is distributed exactly as base-model
    ancestral sampling from the processed distributions.
    (Renormalisation is implicit: acceptance compares u * remaining_mass with
    p(x), and sample() normalises, which avoids dividing by a mass near 0.)
    """
    if callable(target_probs):
        row = target_probs
    else:
        target_probs = np.asarray(target_probs)
        if target_probs.ndim != 2 or target_probs.shape[0] != tree.tokens.shape[0]:
            raise ValueError(f"target_probs must have shape [{tree.tokens.shape[0]}, V], got {target_probs.shape}")
        row = target_probs.__getitem__
    accepted = [0]
    while True:
        node = accepted[-1]
        p = np.array(row(node), dtype=np.float64)  # copy: rejected tokens get zeroed
        for child in tree.children(node):
            token = tree.tokens[child]
            if rng.random() * p.sum() < p[token]:
                accepted.append(int(child))
                break
            p[token] = 0.0
        else:
            return np.array(accepted, dtype=np.int64), sample(p, rng)
