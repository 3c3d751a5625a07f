"""Log-probabilities of generated tokens (generate(..., logprobs=k)): taken from the logits each token
was chosen from, a verify step's for speculated tokens, so equal to plain decoding's (bitwise where
verification is exact); one per token, the greedy token first among the most likely, sorted, the
same streamed, side by side, and cut with a stop string."""
from __future__ import annotations

import numpy as np
import pytest

import runtime


@pytest.fixture(scope="module")
def path(tiny_artifact):
    return tiny_artifact("tiny-llama", "int8", max_length=256)


@pytest.fixture(scope="module")
def gen(path):
    return runtime.load(path)


PROMPT = list(range(7, 60))


def test_speculative_logprobs_are_plain_decodings(gen):
    spec = gen.generate(PROMPT, max_new_tokens=40, logprobs=5)
    plain = gen.generate(PROMPT, max_new_tokens=40, logprobs=5, speculative=False)
    assert gen.verify_exact and spec.token_ids == plain.token_ids
    assert len(spec.logprobs) == len(spec.token_ids)
    for s, p, token in zip(spec.logprobs, plain.logprobs, spec.token_ids):
        assert s == p  # bitwise: the verify rows are the one-token steps' rows
        assert s.token_id == token and s.top[0][0] == token and s.logprob == s.top[0][1]
        values = [lp for _, lp in s.top]
        assert values == sorted(values, reverse=True) and len(values) == 5 and values[0] <= 0


def test_logprobs_are_log_softmax_of_the_logits(gen):
    logits = []
    finish = gen.engine.finish_prefill
    gen.engine.finish_prefill = lambda part: logits.append(np.array(finish(part))) or logits[-1]
    try:
        out = gen.generate(PROMPT, max_new_tokens=1, logprobs=3)
    finally:
        del gen.engine.finish_prefill
    x = logits[-1].astype(np.float64)
    log_p = x - x.max() - np.log(np.exp(x - x.max()).sum())
    assert abs(out.logprobs[0].logprob - log_p[out.token_ids[0]]) < 1e-9
    assert [i for i, _ in out.logprobs[0].top] == list(np.argsort(-log_p, kind="stable")[:3])


def test_sampled_streamed_and_cut_logprobs_match(gen):
    kwargs = dict(max_new_tokens=30, temperature=0.9, seed=3, logprobs=0)
    out = gen.generate(PROMPT, **kwargs)
    events = gen.events(PROMPT, **kwargs)
    streamed, ids = [], []
    with pytest.raises(StopIteration):
        while True:
            event = next(events)
            ids += event.token_ids
            streamed += event.logprobs
    assert ids == out.token_ids and streamed == out.logprobs and all(e.top == [] for e in streamed)
    stop = gen.tokenizer.decode(out.token_ids[5:8])
    if stop.strip():
        cut = gen.generate(PROMPT, stop=stop, **kwargs)
        assert len(cut.logprobs) == len(cut.token_ids) and cut.logprobs == out.logprobs[:len(cut.token_ids)]


def test_side_by_side_logprobs_are_those_alone(path, gen):
    batched = runtime.load(path, parallel=2)
    try:
        outs = batched.generate_many([PROMPT, PROMPT[:30]], max_new_tokens=25, logprobs=2)
    finally:
        batched.close()
    for prompt, out in zip([PROMPT, PROMPT[:30]], outs):
        assert out.logprobs == gen.generate(prompt, max_new_tokens=25, logprobs=2).logprobs


def test_logprobs_out_of_range_are_refused(gen):
    with pytest.raises(ValueError, match="logprobs must be in"):
        gen.generate(PROMPT, max_new_tokens=2, logprobs=21)
    assert gen.generate(PROMPT, max_new_tokens=2).logprobs is None
