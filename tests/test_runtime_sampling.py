"""Lossless sampling through the real runtime: the first three tokens of speculative sampling
follow the exact distribution computed from the base model's probabilities, and the same test
rejects deliberately broken verifiers (so it can fail)."""

import numpy as np
import pytest
import torch
from scipy import stats

import eagle2
import runtime
import runtime.generation as generation
from eagle2 import process_logits
from export.onnx_export import export_onnx
from models.llama import CausalLM, KVCache, causal_bias
from tools.gpu_check import SAMPLING_PROMPT, SAMPLING_VOCAB, sampling_checkpoint

VOCAB, PROMPT = SAMPLING_VOCAB, SAMPLING_PROMPT
DRAWS = 2000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny Llama with a 24-token vocabulary, so exact 3-token distributions are cheap."""
    ckpt = sampling_checkpoint()
    path = tmp_path_factory.mktemp("sampling") / "artifact"
    export_onnx(ckpt, path, "fp32", max_length=64, verify=False, log=lambda m: None)
    gen = runtime.load(path, threads=1)  # tiny graphs: thread sync costs more than it saves
    gen.stop_ids.clear()
    return ckpt, gen


def exact_distribution(ckpt, temperature, top_p, top_k, prompt=PROMPT, allowed=None, min_p=0.0):
    """P(t1, t2, t3) [V, V, V] from the PyTorch twin, processed as the runtime processes logits;
    `allowed(after)`: a grammar's mask [V] of the tokens that may follow token `after`."""
    model = CausalLM(ckpt.cfg).eval()
    model.load_state_dict({k: v for k, v in ckpt.state.items() if k != "lm_head.weight"}, strict=False)
    model.lm_head.weight = torch.nn.Parameter(ckpt.state["lm_head.weight"])
    v, n = VOCAB, len(prompt)
    seqs = np.array([prompt + [a, b] for a in range(v) for b in range(v)])
    with torch.no_grad():
        logits, _ = model(torch.from_numpy(seqs), torch.arange(n + 2).expand(len(seqs), -1),
                          causal_bias(n + 2), KVCache(ckpt.cfg, n + 2, batch=len(seqs)), 0)
    logits = logits.numpy().reshape(v, v, n + 2, v)
    if allowed is not None:
        masks = np.stack([allowed(t) for t in range(v)])  # [after, next]
        logits[:, :, n - 1] = np.where(masks[prompt[-1]], logits[:, :, n - 1], -np.inf)
        logits[:, :, n] = np.where(masks[:, None, :], logits[:, :, n], -np.inf)
        logits[:, :, n + 1] = np.where(masks[None, :, :], logits[:, :, n + 1], -np.inf)
    p = lambda x: process_logits(x, temperature, top_k, top_p, min_p)
    p1 = p(logits[0, 0, n - 1])
    p2 = p(logits[:, 0, n])          # [t1, t2]
    p3 = p(logits[:, :, n + 1])      # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def draw(gen, n, temperature, top_p, top_k, tree=(8, 3, 3), prompt=PROMPT, lookup=0, min_p=0.0):
    counts = np.zeros((VOCAB,) * 3)
    total_tokens, depth, branching = tree
    for seed in range(n):
        out = gen.generate(prompt, max_new_tokens=3, temperature=temperature, top_p=top_p, sampling_top_k=top_k,
                           min_p=min_p, seed=seed, total_tokens=total_tokens, depth=depth, top_k=branching,
                           lookup=lookup)
        counts[tuple(out.token_ids)] += 1
    return counts


def pvalue(counts, exact):
    """Chi-square over the joint of the first three tokens, outcomes with small expected counts
    pooled into one bin; an outcome of probability 0 that occurs fails outright."""
    n = counts.sum()
    if counts[exact == 0].sum() > 0:
        return 0.0
    expected = exact.ravel() * n
    observed = counts.ravel()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


CASES = [(1.0, 1.0, 0), (0.5, 1.0, 0), (1.0, 0.9, 0), (0.7, 1.0, 5)]


@pytest.mark.parametrize("temperature,top_p,top_k", CASES)
def test_speculative_sampling_matches_the_base_distribution(small_vocab, temperature, top_p, top_k):
    ckpt, gen = small_vocab
    exact = exact_distribution(ckpt, temperature, top_p, top_k)
    counts = draw(gen, DRAWS, temperature, top_p, top_k)
    assert pvalue(counts, exact) > ALPHA


def test_speculative_sampling_with_min_p_matches_the_base_distribution(small_vocab):
    ckpt, gen = small_vocab
    exact = exact_distribution(ckpt, 0.8, 1.0, 0, min_p=0.1)
    assert pvalue(draw(gen, DRAWS, 0.8, 1.0, 0, min_p=0.1), exact) > ALPHA


def test_depth_zero_trees_sample_the_base_distribution(small_vocab):
    """A tree drawn from the root's draft children only (one draft call a cycle)."""
    ckpt, gen = small_vocab
    exact = exact_distribution(ckpt, 1.0, 1.0, 0)
    assert pvalue(draw(gen, DRAWS, 1.0, 1.0, 0, tree=(3, 0, 2)), exact) > ALPHA


def test_lookup_branches_sample_the_base_distribution(small_vocab, monkeypatch):
    """Every token occurs once in the prompt and the lookup matches 1-grams, so each cycle's tree
    carries a lookup branch (the prompt's continuation of the newest token) besides the draft's."""
    ckpt, gen = small_vocab
    monkeypatch.setattr(generation, "LOOKUP_NGRAM", 1)
    prompt = np.random.default_rng(0).permutation(VOCAB).tolist()
    exact = exact_distribution(ckpt, 1.0, 1.0, 0, prompt)
    assert pvalue(draw(gen, DRAWS, 1.0, 1.0, 0, tree=(3, 0, 2), prompt=prompt, lookup=3), exact) > ALPHA


class ForbidAfter:
    """A grammar over the small vocabulary: token t may not follow s where (s + t) % 3 == 0, with the
    methods the runtime asks of a constraint (runtime/constraints.JsonConstraint's)."""

    def __init__(self, last: int):
        self.last = last

    @staticmethod
    def allowed(after: int) -> np.ndarray:
        return (after + np.arange(VOCAB)) % 3 != 0

    def end_within(self, tokens: int) -> None:
        """Every sequence of allowed tokens is whole: nothing to finish before the budget ends."""

    def mask(self, row):
        return np.where(self.allowed(self.last), np.asarray(row, np.float32), -np.inf).astype(np.float32)

    def mask_tree(self, tree, logits):
        rows = np.array(logits[:len(tree.tokens)], np.float32)
        for node in range(len(rows)):
            path, u = [], node
            while u > 0:
                path.append(int(tree.tokens[u]))
                u = int(tree.parents[u])
            states = [self.last] + path[::-1]
            if all(self.allowed(a)[b] for a, b in zip(states, states[1:])):
                rows[node] = np.where(self.allowed(states[-1]), rows[node], -np.inf)
        return rows

    def _takes(self, path) -> int:
        """How many of the path's tokens, from the start, the grammar takes."""
        states = [self.last] + list(path)
        return next((i for i, (a, b) in enumerate(zip(states, states[1:])) if not self.allowed(a)[b]), len(path))

    def valid_paths(self, tokens, parents):
        paths = []
        for i in range(len(tokens)):
            path, u = [], i
            while u >= 0:
                path.append(int(tokens[u]))
                u = int(parents[u])
            paths.append(path[::-1])
        return np.array([self._takes(p) == len(p) for p in paths])

    def valid_prefix(self, tokens):
        return list(tokens)[:self._takes(tokens)]

    def consume(self, tokens):
        for t in tokens:
            assert self.allowed(self.last)[t], "a token the grammar forbids was chosen"
            self.last = t


def test_speculative_sampling_keeps_a_grammars_distribution(small_vocab):
    """Each tree row masked after its own path (runtime/constraints.py's rule): the first three tokens
    follow the base's distribution masked by the grammar at each position."""
    ckpt, gen = small_vocab
    exact = exact_distribution(ckpt, 1.0, 1.0, 0, allowed=ForbidAfter.allowed)
    counts = np.zeros((VOCAB,) * 3)
    for seed in range(DRAWS):
        settings = generation.Settings(max_new_tokens=3, temperature=1.0, seed=seed, total_tokens=8, depth=3, top_k=3)
        decoder = generation.Decoder(gen.engine, PROMPT, settings, set(), constraint=ForbidAfter(PROMPT[-1]))
        counts[tuple(t for new in decoder.tokens() for t in new)] += 1
    assert pvalue(counts, exact) > ALPHA


def accept_without_rejection(tree, probs, rng):
    """Broken: takes the draft's first child whenever there is one."""
    accepted = [0]
    while len(tree.children(accepted[-1])):
        accepted.append(int(tree.children(accepted[-1])[0]))
    p = probs(accepted[-1])
    return np.array(accepted), eagle2.sample(p, rng)


def test_the_test_rejects_a_verifier_without_rejection(small_vocab, monkeypatch):
    ckpt, gen = small_vocab
    monkeypatch.setattr(generation, "accept_sampling", accept_without_rejection)
    exact = exact_distribution(ckpt, 1.0, 1.0, 0)
    assert pvalue(draw(gen, DRAWS // 3, 1.0, 1.0, 0), exact) < ALPHA


def test_the_test_rejects_ignoring_top_p(small_vocab, monkeypatch):
    ckpt, gen = small_vocab
    monkeypatch.setattr(generation, "process_logits", lambda x, t, k, p, m: process_logits(x, t, k, 1.0, m))
    exact = exact_distribution(ckpt, 1.0, 0.9, 0)
    assert pvalue(draw(gen, DRAWS // 3, 1.0, 0.9, 0), exact) < ALPHA


def test_plain_sampling_uses_the_same_seed_semantics(small_vocab):
    _, gen = small_vocab
    a = gen.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=11, speculative=False)
    b = gen.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=11, speculative=False)
    assert a.token_ids == b.token_ids
    c = gen.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=11)
    assert c.token_ids == gen.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=11).token_ids
