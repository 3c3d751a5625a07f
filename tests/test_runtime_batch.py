"""Generations decoded side by side (runtime/batch.py) over one engine: each sequence's rows in a
shared step of the base or the draft are bitwise the rows it gets alone, whatever slot of the caches
it holds and whatever else shares the step (beyond 128 rows too), so every generation's tokens are
those generate() gives it alone: greedy, and sampled with a seed."""
import threading

import numpy as np
import pytest

import runtime
from eagle2 import tree_from_parents
from export.onnx_export import export_onnx
from export.onnx_graph import EXACT_KEY_BLOCK
from models.cpu import int8_dot_products
from models.registry import load_checkpoint
from runtime.engine import FIT_SLACK, NoRoom
from runtime.generation import Decoder, PromptTooLongError, tree_label
from runtime.tuning import write_tuning

BLOCK = EXACT_KEY_BLOCK
MAX_LENGTH = 2 * BLOCK


def random_tree(rng, size, vocab):
    parents = np.array([-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, size)])
    return tree_from_parents(rng.integers(0, vocab, size), parents)


@pytest.fixture(scope="module", params=["fp32:exact", "int8:exact", "w8a8:exact", "int8:kernel",
                                                  "w8a16:kernel"])
def pair(request, tmp_path_factory):
    """The same artifact loaded twice: one generation at a time, and four side by side (":kernel":
    ":exact": exported with --attention exact or kernel)."""
    if request.param.startswith("w8a8") and not int8_dot_products():
        pytest.skip("w8a8 artifacts need VNNI or AMX, which this CPU lacks (the runtime refuses them)")
    precision, _, attention = request.param.partition(":")
    path = tmp_path_factory.mktemp("batch") / f"{precision}-{attention}"
    export_onnx(load_checkpoint("tiny-llama"), path, precision, max_length=MAX_LENGTH, verify=False,
                log=lambda m: None, attention=attention or None)
    alone, batched = runtime.load(path), runtime.load(path, parallel=4)
    yield alone, batched
    batched.close()


def test_rows_of_a_shared_step_equal_the_rows_decoded_alone(pair):
    """Three sequences in slots 1-3 (slot 0 left free, so the step binds part of the caches), their
    prompts prefilled side by side, then one step verifying trees of 100, 60 and 90 nodes (250 rows),
    one at the end of a key block and one past it, and one draft step over three frontiers: every
    logit, hidden and top-k row equals its sequence's step alone."""
    alone, batched = pair
    e, vocab = batched.engine, batched.vocab_size
    rng = np.random.default_rng(0)
    contexts, sizes = (BLOCK - 100, 200, BLOCK + 76), (100, 60, 90)
    assert batched.scheduler.load == (0, 0)  # idle: this test drives the engine itself
    spare = e.open_sequence()
    seqs = [e.open_sequence() for _ in contexts]
    e.close_sequence(spare)
    assert [s.slot for s in seqs] == [1, 2, 3]
    prompts = [rng.integers(0, vocab, c) for c in contexts]
    trees = [random_tree(rng, s, vocab) for s in sizes]
    def side_by_side(make, finish):
        """Chunks of 128 rows of every sequence, two sequences a step (a step holds 256 rows)."""
        for start in range(0, max(contexts), 128):
            parts = [make(p, start, s) for p, s in zip(prompts, seqs) if start < len(p)]
            for two in (parts[:2], parts[2:]):
                if two:
                    e.run(two)
                    for part in two:
                        finish(part)

    side_by_side(lambda p, start, s: e.prefill_rows(p[start:start + 128], start, s), e.finish_prefill)
    # The head's context (token j+1 with feature j), as the decoder feeds it after a prefill.
    side_by_side(lambda p, start, s: e.draft_context_rows(np.append(p[1:], 7)[start:start + 128], start, 4, s),
                 lambda part: None)
    parts = [e.verify_rows(t, c, s) for t, c, s in zip(trees, contexts, seqs)]
    e.run(parts)
    assert sum(p.rows for p in parts) > 128
    together = [(p.outputs["logits"].copy(), np.array(p.outputs["hidden"])) for p in parts]
    k = 4
    frontiers = [(rng.integers(0, vocab, k), rng.standard_normal((k, e.hidden_size)).astype(np.float32))
                 for _ in seqs]
    mask = np.eye(k, dtype=bool)
    drafts = [e.draft_expand_rows(tokens, features, mask, c, 0, k, s)
              for (tokens, features), c, s in zip(frontiers, contexts, seqs)]
    e.run(drafts)
    drafted = [tuple(np.array(x) for x in e.finish_draft(d)) for d in drafts]
    for prompt, tree, (logits, hidden), (tokens, features), draft in zip(prompts, trees, together, frontiers,
                                                                         drafted):
        for start in range(0, len(prompt), 128):
            alone.engine.prefill(prompt[start:start + 128], start)
        for start in range(0, len(prompt), 128):
            alone.engine.draft_context(np.append(prompt[1:], 7)[start:start + 128], start, 4)
        np.testing.assert_array_equal(logits, alone.engine.verify(tree, len(prompt)))
        np.testing.assert_array_equal(hidden, alone.engine.solo.last_hidden)
        for got, want in zip(draft, alone.engine.draft_expand(tokens, features, mask, len(prompt), 0, k)):
            np.testing.assert_array_equal(got, want)
    for s in seqs:
        e.close_sequence(s)
    assert e.open_sequences == 0


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "hi",
           "List three prime numbers and explain why each is prime.", "Translate 'good morning' into German.",
           "Why is the sky blue? Answer in one sentence."]


@pytest.mark.parametrize("tree", [dict(speculative=False), dict(total_tokens=8, depth=3, top_k=2, lookup=0),
                                  dict(total_tokens=24, depth=5, top_k=4, lookup=4)])
def test_greedy_outputs_equal_generating_each_alone(pair, tree):
    alone, batched = pair
    want = [alone.generate(p, max_new_tokens=40, **tree) for p in PROMPTS]
    got = batched.generate_many(PROMPTS, max_new_tokens=40, **tree)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]


def test_seeded_samples_equal_generating_each_alone(pair):
    """A seed gives the same reply whatever runs beside it: the draft trees, and so the random
    draws of the acceptance walk, are those of the generation alone."""
    alone, batched = pair
    settings = [dict(temperature=0.8, seed=i, top_p=0.95 if i % 2 else 1.0) for i in range(len(PROMPTS))]
    want = [alone.generate(p, max_new_tokens=40, **s) for p, s in zip(PROMPTS, settings)]
    runs = [batched.events(p, max_new_tokens=40, **s) for p, s in zip(PROMPTS, settings)]
    got = [batched._drain(r) for r in runs]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_stop_strings_and_threads(pair):
    """Requests from several threads at once, with stop strings: each answer is its alone answer."""
    alone, batched = pair
    stop = [" the", "."]
    want = [alone.generate(p, max_new_tokens=30, stop=stop) for p in PROMPTS]
    got = [None] * len(PROMPTS)

    def ask(i):
        got[i] = batched.generate(PROMPTS[i], max_new_tokens=30, stop=stop)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(g.text, g.finish_reason) for g in got] == [(w.text, w.finish_reason) for w in want]


def test_more_requests_than_slots_wait_and_cancelled_ones_give_their_slot_back(tmp_path):
    export_onnx(load_checkpoint("tiny-llama"), tmp_path / "a", "fp32", max_length=256, verify=False,
                log=lambda m: None)
    alone, batched = runtime.load(tmp_path / "a"), runtime.load(tmp_path / "a", parallel=2)
    try:
        long = list(range(3, 200))
        want = alone.generate(long, max_new_tokens=50)
        runs = [batched.events(long, max_new_tokens=50) for _ in range(5)]
        assert batched.scheduler.load[0] <= 2
        assert [batched._drain(r).token_ids for r in runs] == [want.token_ids] * 5
        with pytest.raises(NoRoom):
            [batched.engine.open_sequence() for _ in range(3)]
        for slot in range(2):
            batched.engine.close_sequence(type("S", (), {"slot": slot})())
        cancelled = batched.events(long, max_new_tokens=50)
        next(cancelled)
        cancelled.close()
        done = batched.generate(long, max_new_tokens=50)
        assert done.token_ids == want.token_ids
        assert batched.scheduler.load == (0, 0) and batched.engine.open_sequences == 0
        with pytest.raises(PromptTooLongError):
            batched.generate(list(range(3, 259)))
        with pytest.raises(ValueError):                 # its own fault only: the scheduler goes on
            batched.generate(long, max_new_tokens=5, temperature=0.5, seed=-1)
        assert batched.generate(long, max_new_tokens=50).token_ids == want.token_ids
    finally:
        batched.close()


def test_a_long_generation_ending_shrinks_the_caches_to_what_the_others_need(tmp_path):
    """Every step reads each bound sequence's cache at the capacity of the longest: when a long
    generation ends, the base's caches shrink to what the open ones use (FIT_SLACK or more spare
    positions), and the others' replies stay those they get alone. fit_slack None keeps the
    capacity until no generation is left."""
    export_onnx(load_checkpoint("tiny-llama"), tmp_path / "a", "fp32", max_length=512, verify=False,
                log=lambda m: None)
    alone = runtime.load(tmp_path / "a")
    prompts, lengths = [[3 + i % 250 for i in range(300)], list(range(3, 13))], [4, 60]
    want = [alone.generate(p, max_new_tokens=n).token_ids for p, n in zip(prompts, lengths)]
    for slack in (FIT_SLACK, None):
        batched = runtime.load(tmp_path / "a", parallel=2)
        engine, seen = batched.engine, []
        engine.fit_slack = slack
        fit = engine.fit

        def recorded():
            fit()
            seen.append((engine.open_sequences, engine.base.capacity))

        engine.fit = recorded
        try:
            runs = [batched.events(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
            assert [batched._drain(r).token_ids for r in runs] == want
        finally:
            batched.close()
        assert seen[0][0] == 1 and seen[-1] == (0, 64)  # the long one ended first; idle: the smallest
        assert seen[0][1] <= 128 if slack else seen[0][1] >= 320
        assert engine.cache_positions["read"] >= engine.cache_positions["used"] > 0


def test_prompt_chunks_share_a_step_only_where_the_attention_stays_small(tmp_path, monkeypatch):
    """A step's attention runs over every slot between its first and last sequence, each padded to
    its longest part: a long prompt chunk packs with a short one beside it, not with short ones
    slots away, and every reply stays the one it gets alone."""
    export_onnx(load_checkpoint("tiny-llama"), tmp_path / "a", "fp32", max_length=256, verify=False,
                log=lambda m: None)
    alone, batched = runtime.load(tmp_path / "a"), runtime.load(tmp_path / "a", parallel=4)
    prompt_steps = []
    run = batched.engine.run
    monkeypatch.setattr(batched.engine, "run", lambda parts: (parts[0].prompt and prompt_steps.append(
        (parts[0].graph, [(p.seq.slot, p.rows) for p in parts]))) or run(parts))
    try:
        prompts = [list(range(3, 123)), [5] * 8, [6] * 8, [7] * 8]
        want = [alone.generate(p, max_new_tokens=10).token_ids for p in prompts]
        assert [g.token_ids for g in batched.generate_many(prompts, max_new_tokens=10)] == want
    finally:
        batched.close()
    for _, step in prompt_steps:
        slots, rows = [s for s, _ in step], [r for _, r in step]
        assert (max(slots) - min(slots) + 1) * max(rows) <= 2 * sum(rows)
    for graph in ("base", "draft"):  # {120 rows, 8 beside it}, then {8, 8}
        assert sorted(len(step) for g, step in prompt_steps if g == graph) == [2, 2]


def test_graphs_that_hold_one_sequence_refuse_parallel(tiny_artifact, tmp_path):
    export_onnx(load_checkpoint("tiny-llama"), tmp_path / "fused", "fp32", max_length=256, verify=False,
                attention="fused", log=lambda m: None)
    with pytest.raises(ValueError, match="one sequence at a time"):
        runtime.load(tmp_path / "fused", parallel=2)


def test_a_row_budget_shares_each_step_and_keeps_every_output(tmp_path, monkeypatch):
    """With 12 tree rows a step for four generations that each want 12, EAGLE-2's rerank across the
    trees decides who verifies what: greedy replies stay those alone, and seeded sampled ones keep
    the tree they get alone (theirs is not shared)."""
    export_onnx(load_checkpoint("tiny-llama"), tmp_path / "a", "fp32", max_length=256, verify=False,
                log=lambda m: None)
    alone, batched = runtime.load(tmp_path / "a"), runtime.load(tmp_path / "a", parallel=4, row_budget=12)
    verify_rows = []
    run = batched.engine.run
    monkeypatch.setattr(batched.engine, "run", lambda parts: verify_rows.append(
        sum(p.rows for p in parts if p.kind == "verify")) or run(parts))
    try:
        tree = dict(total_tokens=12, depth=4, top_k=3, lookup=0)
        want = [alone.generate(p, max_new_tokens=30, **tree) for p in PROMPTS]
        assert [g.token_ids for g in batched.generate_many(PROMPTS, max_new_tokens=30, **tree)] == \
            [w.token_ids for w in want]
        assert max(verify_rows) <= 12 < 4 * 12
        sampled = dict(tree, temperature=0.7, seed=5)
        want = [alone.generate(p, max_new_tokens=30, **sampled) for p in PROMPTS]
        assert [g.token_ids for g in batched.generate_many(PROMPTS, max_new_tokens=30, **sampled)] == \
            [w.token_ids for w in want]
    finally:
        batched.close()


class RecordingDecoder(Decoder):
    """Keeps every drafted tree by the context it was drafted at."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trees = {}

    def _draft_tree(self, root, context, head, limit):
        tree = yield from super()._draft_tree(root, context, head, limit)
        self.trees[context] = (tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist())
        return tree


def test_cycles_without_a_tree_leave_the_head_exact(tmp_path):
    """A generation that skips drafting for some cycles (as under load) gives the same greedy tokens,
    and when it drafts again, after the head has caught up on the tokens it skipped in one step,
    it drafts bitwise the tree a generation that drafted every cycle drafts at that context."""
    export_onnx(load_checkpoint("tiny-llama"), tmp_path / "a", "fp32", max_length=256, verify=False,
                log=lambda m: None)
    gen = runtime.load(tmp_path / "a")
    prompt = gen.tokenizer.encode(PROMPTS[0])
    settings = gen._settings(60, True, 8, 3, 2, lookup=4)
    always = RecordingDecoder(gen.engine, prompt, settings, gen.stop_ids)
    want = [t for part in always.tokens() for t in part]
    cycles = iter([True, False, False, True, False, True, True, False, False, False] * 20)
    sometimes = RecordingDecoder(gen.engine, prompt, settings, gen.stop_ids, speculate=lambda: next(cycles))
    assert [t for part in sometimes.tokens() for t in part] == want
    assert 1 in sometimes.stats.accept_lengths                      # plain cycles ran
    shared = set(always.trees) & set(sometimes.trees)
    assert len(shared) >= 5 and len(sometimes.trees) < len(always.trees)
    assert all(always.trees[c] == sometimes.trees[c] for c in shared)


def test_plain_steps_under_the_tuned_load_keep_every_output(tmp_path, monkeypatch):
    """With `runtime tune --batch` having found plain steps faster from 3 generations on, four side by
    side draft no trees until fewer than 3 remain, then draft again; every greedy and seeded reply
    is still the one generate() gives alone (seeded sampled ones keep their trees throughout)."""
    export_onnx(load_checkpoint("tiny-llama"), tmp_path / "a", "fp32", max_length=256, verify=False,
                log=lambda m: None)
    alone = runtime.load(tmp_path / "a")
    write_tuning(tmp_path / "a", "cpu", batch={"tree": tree_label(alone.tree_defaults), "plain_from": 3})
    batched = runtime.load(tmp_path / "a", parallel=4)
    assert batched.scheduler.plain_from == 3 and "plain steps from 3" in batched.describe_default()
    assert alone.scheduler is None and "plain steps" not in alone.describe_default()
    steps = []  # (generations decoding, tree rows verified) per base step with a tree row
    run = batched.engine.run
    monkeypatch.setattr(batched.engine, "run", lambda parts: steps.append(
        (batched.scheduler.load[0], [p.rows for p in parts if p.kind == "verify"])) or run(parts))
    try:
        lengths = [10, 60, 25, 40]  # generations end one after another
        want = [alone.generate(p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
        runs = [batched.events(p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
        assert [batched._drain(r).token_ids for r in runs] == [w.token_ids for w in want]
        verify = [(active, rows) for active, rows in steps if rows]
        assert all(set(rows) == {1} for active, rows in verify if active >= 3)
        assert any(max(rows) > 1 for active, rows in verify if active < 3)
        sampled = dict(temperature=0.7, seed=3)
        want = [alone.generate(p, max_new_tokens=30, **sampled) for p in PROMPTS]
        steps.clear()
        assert [g.token_ids for g in batched.generate_many(PROMPTS, max_new_tokens=30, **sampled)] == \
            [w.token_ids for w in want]
        assert any(max(rows) > 1 for active, rows in steps if rows and active >= 3)
    finally:
        batched.close()
    # A fixed row budget is the caller's own policy; a tuning measured with another tree does not apply.
    assert runtime.load(tmp_path / "a", parallel=2, row_budget=8).scheduler.plain_from is None
    write_tuning(tmp_path / "a", "cpu", batch={"tree": "9/9/9", "plain_from": 3})
    assert runtime.load(tmp_path / "a", parallel=2).scheduler.plain_from is None


def test_a_long_prompt_delays_the_others_by_one_chunk_a_step(tmp_path, monkeypatch):
    """A prompt of several chunks (and the head's catch-up on it) fills one chunk per step of each
    graph: a generation decoding beside it gets a verify step between any two of its chunks, never
    waits for the whole prompt, and both replies stay the ones they get alone."""
    from runtime.engine import PREFILL_CHUNK
    export_onnx(load_checkpoint("tiny-llama"), tmp_path / "a", "fp32", max_length=1024, verify=False,
                log=lambda m: None)
    alone, batched = runtime.load(tmp_path / "a"), runtime.load(tmp_path / "a", parallel=2)
    steps = []
    run = batched.engine.run
    monkeypatch.setattr(batched.engine, "run", lambda parts: steps.append(
        [(p.graph, p.prompt, p.seq.slot, p.rows) for p in parts]) or run(parts))
    long_prompt = [int(t) for t in np.random.default_rng(0).integers(3, 200, 3 * PREFILL_CHUNK + 50)]
    prompts = [[5, 6, 7, 8], long_prompt]
    try:
        want = [alone.generate(p, max_new_tokens=80).token_ids for p in prompts]
        assert [g.token_ids for g in batched.generate_many(prompts, max_new_tokens=80)] == want
    finally:
        batched.close()
    short_slot = steps[0][0][2]
    for graph in ("base", "draft"):
        chunks = [i for i, step in enumerate(steps) for g, prompt, slot, rows in step
                  if g == graph and prompt and slot != short_slot]
        # 3 whole chunks and the rest (the head catches up on later plain cycles' tokens in steps of its own)
        chunks = chunks[:4] if graph == "draft" else chunks
        assert len(chunks) == 4, graph
        assert all(rows <= PREFILL_CHUNK for step in steps for g, prompt, slot, rows in step if prompt)
        for a, b in zip(chunks, chunks[1:]):
            between = [(g, slot) for step in steps[a + 1:b] for g, prompt, slot, _ in step if not prompt]
            assert ("base", short_slot) in between, (graph, a, b)
