"""The default tree sized each cycle by this machine's step costs (runtime/step_costs.py,
eagle2/sizing.py): probed once per machine and kept beside tuning.json, plain steps where rows are
dear, the whole tree where they are free, the same tokens as plain decoding either way, and side by
side the same tokens as alone, trees sized by each generation's share of the batched step."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import runtime
from runtime import step_costs
from runtime.step_costs import ROWS, StepCosts
from runtime.tuning import TUNING_FILE

MAX_LENGTH = 512
PROMPTS = ["Tell me about the sea.", "Count from one to twenty.", "What is a prime number?"]


@pytest.fixture
def artifact(tiny_artifact, tmp_path):
    """A copy of its own: the probe writes into the artifact's directory."""
    path = tmp_path / "tiny"
    shutil.copytree(tiny_artifact("tiny-llama", "fp32", max_length=MAX_LENGTH), path)
    return path


def costs(per_row: float, draft: float = 0.0, one_row: float = 1e-3) -> StepCosts:
    """A table whose verify step costs one_row plus per_row for each row past the first, at any context."""
    verify = tuple(one_row + per_row * (r - 1) for r in ROWS)
    return StepCosts("test", 1, (64, 512), ROWS, (verify, verify), (1, 16), ((draft, draft), (draft, draft)))


def test_the_probe_runs_once_per_machine_and_is_kept(artifact, monkeypatch):
    gen = runtime.load(artifact)
    table = gen.step_costs
    assert table is not None and "sized each cycle" in gen.describe_default()
    assert all(t > 0 for row in table.verify for t in row) and all(t > 0 for row in table.draft for t in row)
    kept = json.loads((artifact / TUNING_FILE).read_text())["cpu"]["step_costs"]
    assert [(c["machine"], c["threads"]) for c in kept] == [(table.machine, table.threads)]

    def no_probe(*args, **kwargs):
        raise AssertionError("probed again on the same machine")
    monkeypatch.setattr(step_costs, "probe", no_probe)
    assert runtime.load(artifact).step_costs == table

    monkeypatch.undo()
    monkeypatch.setattr(step_costs, "cpu_name", lambda: "another CPU")
    assert runtime.load(artifact).step_costs.machine == "another CPU"
    kept = json.loads((artifact / TUNING_FILE).read_text())["cpu"]["step_costs"]
    assert {c["machine"] for c in kept} == {table.machine, "another CPU"}


def test_which_calls_are_sized(artifact):
    gen = runtime.load(artifact)
    assert gen._settings().sizing is gen.step_costs
    assert gen._settings(temperature=0.8).sizing is gen.step_costs
    # A seeded sampled reply must draw what it draws anywhere: its trees are the fixed ones.
    assert gen._settings(temperature=0.8, seed=3).sizing is None
    assert gen._settings(total_tokens=4).sizing is None
    assert gen._settings(lookup=0).sizing is None
    fixed = runtime.load(artifact, size_trees=False)
    assert fixed.step_costs is None and fixed._settings().sizing is None
    assert "sized" not in fixed.describe_default()


def count_draft_steps(gen) -> list:
    steps, run = [], gen.engine.run
    gen.engine.run = lambda parts: (steps.append(parts[0].graph), run(parts))[1]
    return steps


def test_free_rows_verify_the_whole_tree_every_cycle(artifact):
    gen = runtime.load(artifact)
    tree = gen.tree()
    gen.step_costs = costs(per_row=0.0)
    for prompt in PROMPTS:
        sized = gen.generate(prompt, max_new_tokens=48)
        fixed = gen.generate(prompt, max_new_tokens=48, **tree)
        assert sized.token_ids == fixed.token_ids
        assert sized.accept_lengths == fixed.accept_lengths


def test_dear_rows_decode_plain_with_the_same_tokens(artifact):
    gen = runtime.load(artifact)
    gen.step_costs = costs(per_row=1.0, draft=1e-3)
    steps = count_draft_steps(gen)
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_new_tokens=64, speculative=False)
        steps.clear()
        sized = gen.generate(prompt, max_new_tokens=64)
        assert sized.token_ids == plain.token_ids
        assert set(sized.accept_lengths) == {1}
        # Each drafted cycle costs at least twice a plain step and lands one token: drafting stops
        # after the few cycles that outweigh its fair start, and is tried again after 2, 4, 8 then 16
        # plain cycles: a few drafted cycles in 64, each its head's steps (the context's and depth
        # expansions).
        assert steps.count("draft") <= 10 * (gen.tree()["depth"] + 1)


def test_sized_trees_side_by_side_equal_each_alone(artifact):
    alone = runtime.load(artifact)
    batched = runtime.load(artifact, parallel=3)
    try:
        assert batched.step_costs == alone.step_costs
        want = [alone.generate(p, max_new_tokens=40) for p in PROMPTS]
        got = batched.generate_many(PROMPTS, max_new_tokens=40)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        plain = [alone.generate(p, max_new_tokens=40, speculative=False).token_ids for p in PROMPTS]
        assert [w.token_ids for w in want] == plain
    finally:
        batched.close()


def test_the_table_interpolates_rows_and_context():
    table = StepCosts("test", 1, (100, 200), (1, 2, 4), ((1.0, 2.0, 4.0), (3.0, 4.0, 6.0)), (1, 2),
                      ((0.5, 1.0), (1.5, 2.0)))
    np.testing.assert_allclose(table.verify_seconds(5, 100), [1.0, 2.0, 3.0, 4.0, 5.0])
    np.testing.assert_allclose(table.verify_seconds(3, 150), [2.0, 3.0, 4.0])
    np.testing.assert_allclose(table.verify_seconds(1, 300), [5.0])  # past the contexts, at their rate
    assert table.draft_seconds(2, 200) == pytest.approx(2.0)
    # Side by side, one generation's share of a step in which each of them has as many rows.
    np.testing.assert_allclose(table.verify_seconds(2, 100, generations=2), [1.0, 2.0])
    np.testing.assert_allclose(table.verify_seconds(1, 100, generations=3), [1.0])
    assert table.draft_seconds(1, 200, generations=2) == pytest.approx(1.0)


def test_a_size_measured_dearer_than_a_larger_one_takes_the_larger_ones_cost():
    """A probe on a shared machine once measured 2 rows at 9.0 ms and 3 at 7.9: a size's figure is
    the least of its own and every larger size's, so a slow moment cannot make a tree look dear."""
    table = StepCosts("test", 1, (100, 200), (1, 2, 3, 4), ((7.3, 9.0, 7.9, 9.4), (7.7, 9.7, 9.9, 11.7)), (1, 2),
                      ((0.5, 1.0), (1.5, 2.0)))
    np.testing.assert_allclose(table.verify_seconds(4, 100), [7.3, 7.9, 7.9, 9.4])
    np.testing.assert_allclose(table.verify_seconds(4, 200), [7.7, 9.7, 9.9, 11.7])


@pytest.mark.slow
def test_under_load_trees_shrink_to_plain_steps(smollm2_head_artifact, monkeypatch):
    """Rows that cost a hundredth of a step: alone, the whole tree pays every cycle; with 64 generations
    sharing each step, the step's fixed cost is shared and every row costs its rate, so the same table
    decodes (almost) plain, with the same tokens: only the draft's likeliest nodes still pay for a row."""
    from runtime.batch import Scheduler
    table = costs(per_row=1e-5, draft=1e-6)
    alone = runtime.load(smollm2_head_artifact)
    alone.step_costs = table
    batched = runtime.load(smollm2_head_artifact, parallel=3)
    batched.step_costs = table
    try:
        want = [alone.generate(p, max_new_tokens=40) for p in PROMPTS]
        monkeypatch.setattr(Scheduler, "_side_by_side", lambda self: 64)
        got = batched.generate_many(PROMPTS, max_new_tokens=40)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        tau = [np.mean([a for o in outs for a in o.accept_lengths]) for outs in (want, got)]
        assert tau[1] < 1.1 < 1.2 < tau[0], tau
    finally:
        batched.close()
