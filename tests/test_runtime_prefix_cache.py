"""Prefix reuse (runtime/prefix_cache.py): a prompt that starts with an earlier generation's tokens
starts from that generation's caches (base K/V, features, the head's K/V) and must then compute
exactly what a cold run computes: every logit of every step, bitwise, and so the same trees and the
same tokens, at every precision whose steps are exact here. That rests on prefill rows not depending
on the chunks they are computed in, checked here on the base and on the draft side."""
from __future__ import annotations

import numpy as np
import pytest

import runtime
from models.cpu import int8_dot_products
from runtime.engine import PREFILL_CHUNK
from runtime.prefix_cache import Block, PrefixCache

PRECISIONS = ("fp32:exact", "int8:exact", "w8a8:exact", "int8:kernel", "w8a16:kernel")  # export --attention exact or kernel
MAX_LENGTH = 512


@pytest.fixture(scope="module", params=PRECISIONS)
def artifact(request, tiny_artifact):
    if request.param.startswith("w8a8") and not int8_dot_products():
        pytest.skip("w8a8 artifacts need VNNI or AMX, which this CPU lacks (the runtime refuses them)")
    precision, _, attention = request.param.partition(":")
    return tiny_artifact("tiny-llama", precision, max_length=MAX_LENGTH, attention=attention or None)


def ids(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def record_logits(gen) -> list[tuple[int, np.ndarray]]:
    """(the positions filled, logits) of every prefill chunk and verify step the generator runs from now on."""
    logs, engine = [], gen.engine
    prefill, verify = engine.finish_prefill, engine.finish_verify
    engine.finish_prefill = lambda part: logs.append((part.first_slot + part.rows, np.array(prefill(part)))) or logs[-1][1]
    engine.finish_verify = lambda part: logs.append((-1, np.array(verify(part)))) or logs[-1][1]
    return logs


def used(log, prompt_length: int) -> list[np.ndarray]:
    """The logits a generation uses: its prompt's last (earlier chunks' are never read) and its trees'."""
    return [logits for end, logits in log if end in (-1, prompt_length)]


def caches(gen, positions: int, draft_rows: int) -> list[np.ndarray]:
    """The solo sequence's base K/V and features over `positions`, the head's K/V over `draft_rows`."""
    e = gen.engine
    return ([np.array(a[0][:, :positions]) for a in e.base.cache_arrays()] + [np.array(e.solo.features[:positions])]
            + [np.array(a[0][:, :draft_rows]) for a in e.draft.cache_arrays()])


# --- the chunks a prompt is filled in change no bit -----------------------------------------------
def fill(engine, prompt, chunk):
    """Prefill `prompt` and feed the head its rows, in chunks of `chunk`: (last logits, the head's last
    top-k ids and log-probs, base K/V, features, head K/V)."""
    n = len(prompt)
    for start in range(0, n, chunk):
        logits = engine.prefill(prompt[start:start + chunk], start)
    nxt = np.append(prompt[1:], int(logits.argmax()))
    for start in range(0, n, chunk):
        _, top, logp = engine.draft_context(nxt[start:start + chunk], start, 4)
    return ([logits.copy(), top.copy(), logp.copy()] + [np.array(a[0][:, :n]) for a in engine.base.cache_arrays()]
            + [np.array(engine.solo.features[:n])] + [np.array(a[0][:, :n]) for a in engine.draft.cache_arrays()])


def test_prefill_in_other_chunks_changes_no_bit(artifact):
    gen = runtime.load(artifact, prefix_cache_mb=0)
    assert gen.verify_exact
    prompt = np.array(ids(1, 300, gen.vocab_size))
    gen.engine.start(len(prompt))
    want = fill(gen.engine, prompt, PREFILL_CHUNK)
    for chunk in (1, 7, 16, 50, 97):
        got = fill(gen.engine, prompt, chunk)
        for i, (a, b) in enumerate(zip(want, got)):
            assert np.array_equal(a, b), f"chunks of {chunk}: output {i} differs from chunks of {PREFILL_CHUNK}"


# --- a continuation from reused caches is a cold run, bitwise --------------------------------------
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_a_conversation_from_reused_caches_computes_what_a_cold_one_does(artifact, sampling):
    warm = runtime.load(artifact)
    kwargs = dict(max_new_tokens=40, temperature=0.8, seed=5) if sampling else dict(max_new_tokens=40)
    converse(runtime.load(artifact, prefix_cache_mb=0), warm, kwargs)
    stats = warm.prefix_cache.stats()
    assert stats["hits"] == 2 and 0 < stats["hit_tokens"] < stats["prompt_tokens"] and stats["evicted"] == 0


def test_a_conversation_after_evictions_computes_what_a_cold_one_does(tiny_artifact):
    path = tiny_artifact("tiny-llama", "fp32", max_length=MAX_LENGTH)
    cold = runtime.load(path, prefix_cache_mb=0)
    block_bytes = Block(b"", [a[0][:, :16] for a in cold.engine.base.cache_arrays()], cold.engine.solo.features[:16],
                        [a[0][:, :16] for a in cold.engine.draft.cache_arrays()]).nbytes
    warm = runtime.load(path, prefix_cache_mb=7.5 * block_bytes / 2**20)
    v = cold.vocab_size
    first = ids(11, 70, v)
    reply = warm.generate(first, max_new_tokens=40).token_ids  # 6 blocks
    warm.generate(ids(12, 60, v), max_new_tokens=10)  # another conversation's 4 blocks evict its last 3
    assert warm.prefix_cache.evicted == 3 and warm.prefix_cache.bytes <= warm.prefix_cache.budget
    logs = {g: record_logits(g) for g in (cold, warm)}
    prompt = first + reply + ids(13, 20, v)
    outs = [g.generate(prompt, max_new_tokens=40) for g in (cold, warm)]
    assert outs[1].timings["prefix_hit_tokens"] == 48
    assert outs[0].token_ids == outs[1].token_ids and outs[0].accept_lengths == outs[1].accept_lengths
    want, got = used(logs[cold], len(prompt)), used(logs[warm], len(prompt))
    assert len(want) == len(got) and all(np.array_equal(a, b) for a, b in zip(want, got))


def converse(cold, warm, kwargs):
    """Three turns, each resending the last with its reply and new tokens, cold and warm: the same
    logits at every step, the same trees, tokens and caches; the warm turns reuse their history."""
    assert warm.prefix_cache is not None and cold.prefix_cache is None
    logs = {g: record_logits(g) for g in (cold, warm)}
    v, block = cold.vocab_size, warm.prefix_cache.block_tokens
    prompt, kept = ids(2, 70, v), 0
    for turn in range(3):
        outs = [g.generate(prompt, **kwargs) for g in (cold, warm)]
        assert outs[0].token_ids == outs[1].token_ids
        assert outs[0].accept_lengths == outs[1].accept_lengths
        n = len(prompt)
        want, got = used(logs[cold], n), used(logs[warm], n)
        assert len(want) == len(got)
        for step, (a, b) in enumerate(zip(want, got)):
            assert np.array_equal(a, b), f"turn {turn}: the logits of step {step} differ from the cold run's"
        assert all(np.array_equal(a, b) for a, b in zip(caches(cold, n, n - 1), caches(warm, n, n - 1)))
        # The earlier turn's caches held its prompt and reply but for the reply's last token; whole blocks of them.
        assert outs[1].timings["prefix_hit_tokens"] == (kept // block * block if turn else 0)
        for log in logs.values():
            log.clear()
        kept = n + len(outs[0].token_ids) - 1
        prompt = prompt + outs[0].token_ids + ids(3 + turn, 25, v)


def test_a_whole_prompt_hit_still_computes_its_last_token(artifact):
    gen = runtime.load(artifact)
    prompt = ids(4, 64, gen.vocab_size)  # four whole blocks
    first = gen.generate(prompt, max_new_tokens=8)
    again = gen.generate(prompt, max_new_tokens=8)
    assert again.token_ids == first.token_ids
    assert again.timings["prefix_hit_tokens"] == 48  # the block holding the last token is computed again


def test_plain_decoding_reuses_the_base_and_a_later_tree_catches_the_head_up(tiny_artifact):
    path = tiny_artifact("tiny-llama", "fp32", max_length=MAX_LENGTH)
    cold, warm = runtime.load(path, prefix_cache_mb=0), runtime.load(path)
    prompt = ids(5, 90, cold.vocab_size)
    reply = warm.generate(prompt, max_new_tokens=30, speculative=False)
    assert reply.token_ids == cold.generate(prompt, max_new_tokens=30, speculative=False).token_ids
    stored = warm.prefix_cache._blocks
    assert len(stored) == 7 and all(b.draft is None for b in stored.values())  # the head never ran
    following = prompt + reply.token_ids + ids(6, 10, cold.vocab_size)
    outs = [g.generate(following, max_new_tokens=30) for g in (cold, warm)]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].accept_lengths == outs[1].accept_lengths
    assert outs[1].timings["prefix_hit_tokens"] == 112
    assert all(b.draft is not None for b in list(stored.values())[-7:])


# --- side by side ---------------------------------------------------------------------------------
def test_streams_sharing_a_stored_prefix_decode_as_alone_and_leave_it_as_it_was(tiny_artifact):
    path = tiny_artifact("tiny-llama", "fp32", max_length=MAX_LENGTH)
    alone = runtime.load(path, prefix_cache_mb=0)
    batched = runtime.load(path, parallel=3)
    try:
        v = alone.vocab_size
        system = ids(7, 80, v)
        prompts = [system + ids(10 + i, 20 + 7 * i, v) for i in range(3)]
        batched.generate(prompts[0], max_new_tokens=8)
        stored = {k: [a.copy() for a in b.base] + [b.features.copy()] for k, b in batched.prefix_cache._blocks.items()}
        outs = batched.generate_many(prompts, max_new_tokens=30)
        for p, out in zip(prompts, outs):
            want = alone.generate(p, max_new_tokens=30)
            assert out.token_ids == want.token_ids and out.accept_lengths == want.accept_lengths
            assert out.timings["prefix_hit_tokens"] >= 80 - 16
        for key, arrays in stored.items():
            block = batched.prefix_cache._blocks[key]
            assert all(np.array_equal(a, b) for a, b in zip(arrays, block.base + [block.features]))
    finally:
        batched.close()


def test_cancelling_a_generation_while_its_prompt_fills_frees_its_slot_before_the_next_step(tiny_artifact):
    gen = runtime.load(tiny_artifact("tiny-llama", "fp32", max_length=MAX_LENGTH), parallel=2, prefix_cache_mb=0)
    try:
        chunks, run = [], gen.engine.run

        def cancelling(parts):  # the request is cancelled while its first chunk runs
            if parts[0].kind == "prefill":
                chunks.append(len(parts[0].ids))
                for request in list(gen.scheduler._active):
                    gen.scheduler.cancel(request)
            run(parts)
        gen.engine.run = cancelling
        out = gen.generate(ids(8, 3 * PREFILL_CHUNK, gen.vocab_size), max_new_tokens=10)
        assert out.finish_reason == "cancelled" and out.token_ids == []
        assert chunks == [PREFILL_CHUNK]
        assert gen.scheduler.load == (0, 0) and gen.engine.open_sequences == 0
    finally:
        gen.close()


# --- the store ------------------------------------------------------------------------------------
def block(key: bytes, nbytes: int, draft: bool = True) -> Block:
    return Block(key, [np.zeros(nbytes // 2, np.uint8)], np.zeros(nbytes - nbytes // 2, np.uint8),
                 [np.zeros(0, np.uint8)] if draft else None)


def test_the_least_recently_used_leaf_goes_first_and_the_budget_holds():
    cache = PrefixCache(budget_bytes=5 * 100, block_tokens=4)
    a, b = list(range(12)), list(range(8)) + [99, 98, 97, 96]
    ka, kb = cache.keys(a), cache.keys(b)
    assert ka[:2] == kb[:2] and ka[2] != kb[2]  # chained: equal while the tokens are
    cache.insert(ka, {k: block(k, 100) for k in ka})
    cache.insert(kb, {kb[2]: block(kb[2], 100)})
    assert cache.blocks == 4 and cache.bytes == 400
    assert cache.lookup(a + [1]).tokens == 12  # a is now the most recent
    cache.insert(cache.keys(list(range(50, 58))), {k: block(k, 100) for k in cache.keys(list(range(50, 58)))})
    # Two new blocks in a budget of five: b's own block went, the shared ones (a's parents) stayed.
    assert cache.bytes <= 500 and cache.evicted == 1
    assert cache.lookup(b + [1]).tokens == 8 and cache.lookup(a + [1]).tokens == 12


def test_a_lookup_leaves_the_last_token_and_counts_head_rows_only_as_far_as_stored():
    cache = PrefixCache(budget_bytes=10_000, block_tokens=4)
    tokens = list(range(16))
    keys = cache.keys(tokens)
    cache.insert(keys, {k: block(k, 10, draft=i < 2) for i, k in enumerate(keys)})
    hit = cache.lookup(tokens)
    assert (hit.tokens, hit.draft_tokens) == (12, 8)
    wanted = cache.missing(keys, drafted=16)  # now with the head's rows
    assert [(i, stored) for i, _, _, stored in wanted] == [(2, cache._blocks[keys[2]]), (3, cache._blocks[keys[3]])]
    assert cache.missing(keys, drafted=8) == []


def test_a_chain_longer_than_the_budget_keeps_its_start():
    cache = PrefixCache(budget_bytes=250, block_tokens=4)
    keys = cache.keys(list(range(20)))
    cache.insert(keys, {k: block(k, 100) for k in keys})
    assert cache.blocks == 2 and cache.lookup(list(range(21))).tokens == 8


# --- where it is off -----------------------------------------------------------------------------
def test_reuse_is_refused_where_steps_are_not_exact(tiny_artifact):
    path = tiny_artifact("tiny-llama", "fp32", attention="fused")
    gen = runtime.load(path)
    assert gen.prefix_cache is None and "verify_exact" in gen.describe_prefix_cache()
    with pytest.raises(ValueError, match="prefix reuse needs"):
        runtime.load(path, prefix_cache_mb=64)
    assert runtime.load(path, prefix_cache_mb=0).prefix_cache is None
