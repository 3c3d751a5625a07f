"""`python -m runtime tune` chooses and records a tree the runtime then uses; `python -m runtime.bench`
measures configurations side by side and writes its report; the prompt sets load."""
import json

import numpy as np
import pytest

import runtime
from eagle2 import tree_from_parents
from export.common import DEFAULT_TREE
from runtime.generation import DEFAULT_LOOKUP, as_tree, tree_label
from runtime import bench, tune
from runtime.prompts import load_prompts
from runtime.tuning import TUNING_FILE, read_tuning
from tools import acceptance

# The tree "default" names for the int8 artifact (no tuning recorded), as list and as "n/d/k".
DEFAULT = [DEFAULT_TREE["int8"][k] for k in ("total_tokens", "depth", "top_k")] + [DEFAULT_LOOKUP]
DEFAULT_NAME = tree_label(as_tree(DEFAULT))


def test_acceptance_of_smaller_trees_from_one_cycle():
    # Root 0; nodes 1..4 ranked by score: 1 (-0.1), 3 (-0.2), 2 (-0.5), 4 (-0.9).
    tree = tree_from_parents([9, 1, 2, 3, 4], [-1, 0, 0, 1, 3], scores=[0, -0.1, -0.5, -0.2, -0.9])
    accepted = np.array([0, 1, 3, 4])
    assert [tune.accepted_within(tree, accepted, n) for n in (1, 2, 3, 4, 5)] == [1, 2, 3, 3, 4]


@pytest.fixture
def artifact(tiny_artifact, tmp_path):
    import shutil
    path = tmp_path / "tiny"
    shutil.copytree(tiny_artifact("tiny-llama", "int8"), path)
    return path


def test_tune_records_a_tree_the_runtime_uses(artifact, capsys):
    assert tune.main([str(artifact), "--n", "2", "--max-new-tokens", "24", "--depths", "1,2", "--top-ks", "1,2",
                      "--plot", str(artifact / "tune.png")]) == 0
    result = json.loads((artifact / TUNING_FILE).read_text())["cpu"]
    assert result["machine"] and result["plain_tokens_per_s"] > 0 and len(result["confirmed"]) == 2 * tune.CONFIRM
    # every candidate is confirmed with and without the lookup branch
    assert sum("+" in c["tree"] for c in result["confirmed"]) == tune.CONFIRM
    assert set(result["verify_ms"]) == {str(n) for n in range(1, tune.MAX_TOTAL + 1)}
    assert set(result["draft_ms"]) == {"1/1", "1/2", "2/1", "2/2"}
    # The predictions: tau / cycle time, best first; a tree of n tokens lands 1 to n tokens a cycle.
    predicted = result["predicted"]
    assert [p["tokens_per_s"] for p in predicted] == sorted((p["tokens_per_s"] for p in predicted), reverse=True)
    for p in predicted:
        assert 1.0 <= p["tau"] <= p["total_tokens"] and p["depth"] in (1, 2) and p["top_k"] in (1, 2)
        assert p["tokens_per_s"] == pytest.approx(1e3 * p["tau"] / p["cycle_ms"])
        draft_ms = result["draft_ms"][f"{p['depth']}/{p['top_k']}"]
        assert p["cycle_ms"] >= result["verify_ms"][str(p["total_tokens"])] + draft_ms  # plus the host's share
    # The confirmed trees are the best predicted ones; the chosen one is the fastest confirmed, if it beats plain.
    best = [tree_label(dict(total_tokens=p["total_tokens"], depth=p["depth"], top_k=p["top_k"], lookup=0))
            for p in predicted[:tune.CONFIRM]]
    assert [c["tree"] for c in result["confirmed"] if "+" not in c["tree"]] == best
    for c in result["confirmed"]:
        assert c["speedup"] == pytest.approx(c["tokens_per_s"] / result["plain_tokens_per_s"])
    fastest = max(result["confirmed"], key=lambda c: c["tokens_per_s"])
    chosen = tree_label(result["tree"]) if result["tree"] else None
    assert chosen == (fastest["tree"] if fastest["speedup"] > 1 else None)
    assert (artifact / "tune.png").stat().st_size > 0
    gen = runtime.load(artifact)
    assert result["machine"] in gen.describe_default()
    if result["tree"] is None:
        assert not gen.speculative_default and "plain decoding" in gen.describe_default()
    else:
        assert gen.tree_defaults == result["tree"] and gen.speculative_default
    # Another provider was not tuned: it keeps the artifact's own default.
    assert read_tuning(artifact, "openvino") is None
    assert "chosen for provider cpu" in capsys.readouterr().out


def test_tune_measures_costs_only_where_acceptance_would_take_too_long(artifact, tmp_path, capsys):
    """A large model on few cores (or random weights): verify cost by rows and the draft's cost, no
    acceptance runs and no tree chosen; the same when asked with --costs-only."""
    out = tmp_path / "costs.json"
    assert tune.main([str(artifact), "--budget-minutes", "0.0001", "--n", "2", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "measuring costs only, choosing no tree" in err
    assert "tree" not in (read_tuning(artifact, "cpu") or {})  # what the load kept there is its step costs
    costs = json.loads(out.read_text())
    assert [int(n) for n in costs["verify_ms"]] == list(tune.COST_ROWS)
    assert costs["verify_vs_one_row"]["1"] == 1.0
    assert all(abs(costs["verify_ms"][n] / costs["verify_ms"]["1"] - r) < 1e-9
               for n, r in costs["verify_vs_one_row"].items())
    assert costs["tree"] == tree_label({**DEFAULT_TREE["int8"], "lookup": 0}) and costs["draft_ms_per_cycle"] > 0
    assert tune.main([str(artifact), "--costs-only"]) == 0
    assert "rows:" in capsys.readouterr().out


def test_tune_measures_the_draft_by_depth(artifact, tmp_path, capsys):
    """--rows and --draft-depths: the verify sizes asked for, the draft's cost at each depth (what
    tools/projection.py projects large models from), and plain decoding's cost a token."""
    out = tmp_path / "costs.json"
    assert tune.main([str(artifact), "--costs-only", "--rows", "1,3", "--draft-depths", "1,2", "--draft-top-k", "2",
                      "--n", "1", "--json", str(out)]) == 0
    costs = json.loads(out.read_text())
    assert list(costs["verify_ms"]) == ["1", "3"] and costs["draft_top_k"] == 2
    assert list(costs["draft_ms_by_depth"]) == ["1", "2"] and all(v > 0 for v in costs["draft_ms_by_depth"].values())
    assert costs["plain_ms_per_token"] > 0
    assert "at depth 2, top_k 2" in capsys.readouterr().out


def test_bench_reports_every_configuration(artifact, tmp_path):
    out = tmp_path / "bench"
    assert bench.main([str(artifact), "--prompts", "builtin", "--n", "2", "--max-new-tokens", "20",
                       "--trees", "default,6/3/2", "--report", f"{out}.md", "--json", f"{out}.json",
                       "--plot", f"{out}.png", "--reference", str(artifact)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [r["tree"] for r in data["rows"]] == [None, DEFAULT, [6, 3, 2, 0]]
    plain, *trees = data["rows"]
    assert plain["vs_plain"] == 1.0 and plain["tau"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["gb_per_s"] > 0 for r in data["rows"])
    # Greedy trees are lossless: every token as plain decoding's.
    assert all(r["same_as_plain"] == 1.0 for r in data["rows"])
    # tau is what the runtime's own generations of the same prompts give, every cycle counted.
    gen = runtime.load(artifact)
    gen.stop_ids.clear()  # the benchmark decodes exactly --max-new-tokens
    ids = [gen.tokenizer.apply_chat_template([{"role": "user", "content": q.text}])
           for q in load_prompts("builtin")[:2]]
    for r in trees:
        lengths = [n for p in ids for n in gen.generate(p, max_new_tokens=20, **as_tree(r["tree"])).accept_lengths]
        assert r["tau"] == pytest.approx(sum(lengths) / len(lengths)), r["config"]
    # Weight bytes per token: the base graph's, plus the draft's for each of a cycle's calls, over tau.
    base = bench.graph_weight_bytes(artifact, gen.manifest["graphs"]["base"])
    draft = bench.graph_weight_bytes(artifact, gen.manifest["graphs"]["draft"])
    assert plain["weight_mb_per_token"] == pytest.approx(base / 1e6)
    for r in trees:
        depth = r["tree"][1]
        assert r["weight_mb_per_token"] == pytest.approx((base + (depth + 1) * draft) / r["tau"] / 1e6)
    for r in data["rows"]:
        assert r["vs_plain"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        assert r["gb_per_s"] == pytest.approx(r["weight_mb_per_token"] * r["tokens_per_s"] / 1e3)
    # The artifact against itself: every greedy token agrees.
    assert data["quality"][str(artifact)]["top1_agreement"] == 1.0
    assert "| configuration | tok/s |" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_runs_artifacts_of_a_worker_provider_in_a_worker(artifact, tmp_path, monkeypatch):
    """--worker cpu=PYTHON: each cpu artifact decodes in its own runtime.bench_worker process (here
    under this interpreter), prompt by prompt; the figures come back as from this process."""
    import shutil
    import sys
    started = []
    popen = bench.subprocess.Popen
    monkeypatch.setattr(bench.subprocess, "Popen", lambda args, **kw: started.append(args) or popen(args, **kw))
    second = tmp_path / "second"
    shutil.copytree(artifact, second)
    out = tmp_path / "bench.json"
    assert bench.main([f"{artifact}@cpu", str(second), "--worker", f"cpu={sys.executable}", "--prompts", "builtin",
                       "--n", "2", "--max-new-tokens", "16", "--trees", "4/1/2+8", "--json", str(out)]) == 0
    assert [a[:3] for a in started] == [[sys.executable, "-m", "runtime.bench_worker"]] * 2
    rows = json.loads(out.read_text())["rows"]
    assert [r["tree"] for r in rows] == [None, [4, 1, 2, 8]] * 2
    assert rows[1]["tau"] == rows[3]["tau"] >= 1.0 and rows[1]["verify_ms"] > 0
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_bench_worker_refusals(artifact):
    with pytest.raises(SystemExit, match="PROVIDER=PYTHON"):
        bench.main([str(artifact), "--worker", "cpu"])
    with pytest.raises(SystemExit, match="cannot start its worker"):
        bench.main([str(artifact), "--worker", "cpu=/nonexistent/python", "--n", "1"])


def test_acceptance_by_category(artifact, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there", "category": "chat"}\n{"prompt": "1 + 1 =", "category": "math"}\n')
    assert acceptance.main([str(artifact), "--prompts", f"builtin,{prompts}", "--trees", "6/3/2,default",
                            "--max-new-tokens", "16", "--json", str(tmp_path / "tau.json"),
                            "--report", str(tmp_path / "tau.md")]) == 0
    results = json.loads((tmp_path / "tau.json").read_text())["results"][str(artifact)]
    assert set(results) == {"6/3/2", DEFAULT_NAME}
    for cats in results.values():
        assert set(cats) == {"builtin", "chat", "math"}
        assert all(cycles > 0 and cycles <= accepted <= 4 * cycles for accepted, cycles in cats.values())
    assert "| tiny | 6/3/2 |" in (tmp_path / "tau.md").read_text()


def test_prompt_sets():
    assert len(load_prompts("builtin")) == 8
    mt = load_prompts("mtbench")
    assert len(mt) == 80 and len({p.category for p in mt}) == 8
    two = load_prompts("mtbench:2")
    assert len(two) == 16 and all(sum(p.category == c for p in two) == 2 for c in {p.category for p in two})
    assert len(load_prompts("gsm8k:5")) == 5
    with pytest.raises(FileNotFoundError, match="unknown prompt set"):
        load_prompts("no-such-set")


@pytest.mark.slow
@pytest.mark.parametrize("name,module", [("genai", "onnx_ir"), ("llamacpp", "llama_cpp")])
def test_peers_decode_the_requested_tokens(name, module, smollm2_artifact):
    import importlib.util
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"the {name} peer is not installed (bash ci/install_peers.sh)")
    from runtime.peers import make_peers
    gen = runtime.load(smollm2_artifact)
    ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    for peer in make_peers([name], "smollm2-135m"):
        seconds = peer.decode(ids, 16)
        assert 0 < seconds < 30 and peer.weight_bytes > 50e6, peer.name


@pytest.mark.slow
def test_the_llamacpp_peer_takes_a_gguf_file(smollm2_artifact):
    """A user's own GGUF of the same weights (--peer-model FILE.gguf) decodes as it is, named by its
    quantization; a missing file is refused by name."""
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("the llamacpp peer is not installed (bash ci/install_peers.sh)")
    from models.registry import embedded_gguf
    from runtime.peers import PeerError, make_peers
    gen = runtime.load(smollm2_artifact)
    ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    gguf = embedded_gguf()
    [peer] = make_peers(["llamacpp"], str(gguf))
    assert peer.name == "llama.cpp Q4_1" and peer.weight_bytes == gguf.stat().st_size
    assert 0 < peer.decode(ids, 16) < 30
    assert [p.name for p in make_peers(["llamacpp"], f"{gguf},{gguf}")] == ["llama.cpp Q4_1"] * 2
    with pytest.raises(PeerError, match="no GGUF file missing.Q8_0.gguf"):
        make_peers(["llamacpp"], f"{gguf},missing.Q8_0.gguf")


def test_artifact_specs_name_provider_and_openvino_hint():
    assert bench.split_spec("a/b@openvino:bf16", "cpu") == ("a/b", "openvino", "bf16")
    assert bench.split_spec("a/b", "cpu") == ("a/b", "cpu", None)
    assert bench.split_spec("a/b@openvino", "cpu") == ("a/b", "openvino", None)
    with pytest.raises(SystemExit, match="OpenVINO option"):
        bench.split_spec("a/b@cpu:bf16", "cpu")


def test_batch_levels_and_threshold():
    assert tune.batch_levels(1) == [1] and tune.batch_levels(16) == [1, 2, 4, 8, 16]
    assert tune.batch_levels(6) == [1, 2, 4, 6]
    speeds = lambda *pairs: [{"sequences": 2 ** i, "trees_tokens_per_s": t, "plain_tokens_per_s": p}
                             for i, (t, p) in enumerate(pairs)]
    assert tune.plain_threshold(speeds((130, 90), (200, 210), (230, 300))) == 2
    # plain must stay faster at every larger load measured; between 4 (trees 5 % ahead) and 8 (plain
    # 30 % ahead) the crossing is interpolated: 2 ** (2 + 0.045 / 0.31) = 4.4
    assert tune.plain_threshold(speeds((130, 90), (200, 210), (230, 220), (230, 300))) == 5
    assert tune.plain_threshold(speeds((130, 90), (200, 150))) is None
    assert tune.plain_threshold(speeds((100, 120), (200, 300))) == 1


def test_tune_batch_records_from_how_many_plain_steps_win(artifact, capsys):
    assert tune.main([str(artifact), "--batch", "4", "--n", "3", "--max-new-tokens", "16"]) == 0
    result = read_tuning(artifact, "cpu")["batch"]
    assert [level["sequences"] for level in result["levels"]] == [1, 2, 4]
    assert all(level["trees_tokens_per_s"] > 0 and level["plain_tokens_per_s"] > 0 for level in result["levels"])
    assert result["plain_from"] == tune.plain_threshold(result["levels"]) and result["tree"] == DEFAULT_NAME
    assert "chosen for provider cpu, tree " + DEFAULT_NAME in capsys.readouterr().out
    batched = runtime.load(artifact, parallel=4)
    try:
        assert batched.scheduler.plain_from == result["plain_from"]
    finally:
        batched.close()
    # Only the batch was tuned: one generation at a time keeps the artifact's tree.
    assert "the artifact's default" in runtime.load(artifact).describe_default()


def test_batch_bench_runs_trees_and_plain_steps_side_by_side(artifact):
    from tools import batch_bench
    result = batch_bench.run(str(artifact), "builtin", [1, 2], [None], 12, plain_from=(1,))
    side = [r for r in result["rows"] if r["mode"] == "side by side"]
    assert [(r["concurrency"], r["plain_from"]) for r in side] == [(1, None), (2, None), (1, 1), (2, 1)]
    assert all(r["tokens_per_s"] > 0 and r["verify_ms"] > 0 for r in side)
    assert all(r["draft_ms"] == 0 for r in side if r["plain_from"] == 1)
    assert all(r["cache_read_per_step"] >= r["cache_used_per_step"] > 0 for r in side)
    assert "| side by side | 2 | none | 1 | 128 |" in batch_bench.table(result)
    with pytest.raises(SystemExit, match="runtime tune"):
        batch_bench.run(str(artifact), "builtin", [2], [], 12, plain_from=("tuned",))


def test_batch_bench_times_a_step_by_cache_capacity(artifact):
    from tools import batch_bench
    result = batch_bench.step_costs(str(artifact), [1, 2], [64, 128], repeats=2)
    assert [(r["sequences"], r["capacity"]) for r in result["rows"]] == [(1, 64), (1, 128), (2, 64), (2, 128)]
    assert all(r["step_ms"] > 0 for r in result["rows"])
    assert "| 2 | " in batch_bench.costs_table(result)


@pytest.mark.slow
def test_the_openvino_genai_peer_decodes_and_batches(smollm2_artifact):
    """OpenVINO GenAI in its own environment: plain, prompt-lookup and EAGLE-3 (this project's head,
    converted by optimum-intel) decode exactly the tokens asked for; its continuous batching answers
    every request, at most max_tokens each, with a first-token time."""
    from runtime.peers import OPENVINO_GENAI, OpenVinoGenaiWorker, make_peers, openvino_model
    if not (OPENVINO_GENAI / "optimum-cli").exists():
        pytest.skip("the openvino-genai peer is not installed (bash ci/install_peers.sh)")
    gen = runtime.load(smollm2_artifact)
    ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    peers = make_peers(["openvino-genai"], "smollm2-135m")
    assert [p.mode for p in peers] == ["plain", "prompt-lookup", "eagle3"]
    for peer in peers:
        answer = peer.worker.ask({"ids": ids, "n": 16})
        assert len(answer["tokens"]) == 16 and 0 < answer["seconds"] < 30, peer.mode
        assert peer.weight_bytes > 50e6
        peer.worker.close()
    worker = OpenVinoGenaiWorker(openvino_model("smollm2-135m"), "batch")
    done = worker.ask({"requests": [ids, ids[:-3], ids], "streams": 2, "max_tokens": 12})
    worker.close()
    assert len(done["results"]) == 3 and done["wall"] > 0
    for r in done["results"]:
        assert 0 < r["tokens"] <= 12 and len(r["ids"]) == r["tokens"] and r["ttft"] > 0
        assert len(r["gaps"]) == r["chunks"] - 1
    # as runtime.load_bench runs it beside the servers: the same figures as theirs
    from runtime import load_bench
    results, wall, rss = load_bench._openvino_genai_load(openvino_model("smollm2-135m"), [ids, ids], 2, 8)
    row = load_bench._summary("openvino-genai", "OpenVINO GenAI", 2, results, wall, rss, None)
    assert row["tokens"] == 16 and row["tokens_per_s"] > 0 and row["peak_rss_mib"] > 100
