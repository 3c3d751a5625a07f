"""The exact attention's caches: bound at a capacity that grows (and shrinks for a new prompt) in
steps, inside stores allocated once, keeping every cached row where the graph expects it."""
import numpy as np

import runtime
from runtime.session import CACHE_STEP


def test_growing_and_shrinking_keeps_the_cached_rows(tiny_artifact):
    gen = runtime.load(tiny_artifact("tiny-llama", "int8"))
    base = gen.engine.base
    assert base.grows and base.capacity == CACHE_STEP
    stores = [s.__array_interface__["data"][0] for s in base.store._stores]
    rng = np.random.default_rng(0)
    used = CACHE_STEP - 3
    for a in base.cache_arrays():
        a[:, :, :used] = rng.standard_normal(a[:, :, :used].shape)
    before = [a[:, :, :used].copy() for a in base.cache_arrays()]
    assert base.reserve(CACHE_STEP + 1) == 2 * CACHE_STEP
    for a, b in zip(base.cache_arrays(), before):
        assert a.shape[2] == 2 * CACHE_STEP
        np.testing.assert_array_equal(a[:, :, :used], b)
    assert base.reserve(10) == 2 * CACHE_STEP  # no shrinking unless asked
    assert base.reserve(10, shrink=True) == CACHE_STEP
    for a, b in zip(base.cache_arrays(), before):
        np.testing.assert_array_equal(a[:, :, :used], b)
    # Still the same memory: nothing was allocated.
    assert [s.__array_interface__["data"][0] for s in base.store._stores] == stores
    assert all(np.shares_memory(a, s) for a, s in zip(base.cache_arrays(), base.store._stores))


def test_generation_across_capacity_steps_is_lossless(tiny_artifact):
    """Prompts and replies that cross one and two steps of capacity, then a short prompt (the caches
    shrink back): speculative output equals plain output throughout."""
    gen = runtime.load(tiny_artifact("tiny-llama", "int8"), max_length=3 * CACHE_STEP)
    rng = np.random.default_rng(1)
    for length, new in ((CACHE_STEP - 20, 60), (2 * CACHE_STEP - 10, 40), (5, 30)):
        prompt = rng.integers(0, 256, length).tolist()
        plain = gen.generate(prompt, max_new_tokens=new, speculative=False)
        spec = gen.generate(prompt, max_new_tokens=new, total_tokens=8, depth=3, top_k=3)
        assert spec.token_ids == plain.token_ids
        assert gen.engine.base.capacity >= length + len(plain.token_ids)
    assert gen.engine.base.capacity == CACHE_STEP
