"""The draft-head trainer on the tiny random Llama: data rendering, batched self-distillation,
a short training run that lowers the loss, the official head format, and --resume."""
import json
import random

import numpy as np
import pytest
import torch

from models.llama import EagleHead, causal_bias
from models.tiny import randomize, tiny_checkpoint
from models.train_data import Conversation, encode, iter_json_array, normalize, is_dev
from models.weights import head_tensor_shapes, load_head
from training.batches import Batch
from training.cache import ShardRows, load_splits, save_shard
from training.features import base_hidden, build_base, generate_batch
from training.heads import head_config
from training.replies import read_replies, replies_file
from training.train_head import main
from training.unroll import new_cache, unrolled_forward

WORDS = ("the cat sat on a mat and then it ran to the big red house where many dogs live happily ever "
         "after one day").split()


def write_conversations(path, n=24, seed=0):
    r = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"from": "gpt", "value": "a leftover reply from a split conversation"}] if i % 5 == 4 else []
            for _ in range(2):
                turns.append({"from": "human", "value": " ".join(r.choice(WORDS) for _ in range(r.randint(3, 8)))})
                # Replies repeat a pattern so a few steps of training can pick it up.
                turns.append({"from": "gpt", "value": " ".join(WORDS[(k * 3) % len(WORDS)] for k in range(r.randint(20, 40)))})
            f.write(json.dumps({"id": f"conv{i}_0", "conversations": turns}) + "\n")
    return path


def test_truncated_json_array_and_roles():
    text = '[\n {"id": "a_0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},' \
           '\n {"id": "b_0", "conversations": [{"from": "gpt", "value": "tr'
    recs = list(iter_json_array(text))
    assert [r["id"] for r in recs] == ["a_0"]
    conv = normalize("x", [{"from": "gpt", "value": "cont"}, {"from": "human", "value": "q"},
                           {"from": "gpt", "value": "a"}, {"from": "human", "value": "dangling"}])
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]
    assert normalize("y", [{"from": "human", "value": "only a question"}]) is None
    # All parts of one split ShareGPT conversation land on the same side of the dev split.
    assert len({is_dev(f"QWJhYvA_{k}", 50.0) for k in range(10)}) == 1


def test_assistant_mask_covers_replies_and_end_of_turn():
    tok = tiny_checkpoint("llama").tokenizer
    conv = Conversation("c", [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world!"},
                              {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}])
    ex = encode(tok, conv, 1000)
    marked = tok.decode(ex.ids[ex.mask.astype(bool)].tolist())
    assert marked == "world!<|im_end|>ok<|im_end|>"
    short = encode(tok, conv, 30)
    assert len(short.ids) == 30 and np.array_equal(short.mask, ex.mask[:30])


def test_batched_generation_matches_full_forward():
    ckpt = tiny_checkpoint("llama")
    base = build_base(ckpt, 256, "cpu")
    prompts = [np.array([257, 5, 6, 7, 8, 9, 10], np.int32), np.array([257, 40, 41], np.int32)]
    out = generate_batch(base, prompts, 12, 0.0, None, "cpu")
    for (ids, mask, feats), p in zip(out, prompts):
        assert np.array_equal(ids[:len(p)], p) and mask[:len(p)].sum() == 0 and mask[len(p):].all()
        t = len(ids)
        x = torch.from_numpy(ids.astype(np.int64))[None]
        with torch.no_grad():
            h = base_hidden(base, x, torch.arange(t)[None], causal_bias(t), new_cache(base.cfg, t, 1, "cpu"), 0)
            greedy = base.lm_head(h).argmax(-1)[0]
        np.testing.assert_allclose(feats.astype(np.float32), h[0].numpy(), atol=2e-2, rtol=1e-2)
        # every generated token is the base's greedy choice after the tokens before it
        assert np.array_equal(ids[len(p):], greedy[len(p) - 1:t - 1].numpy())


def test_training_lowers_loss_writes_official_head_and_resumes(tmp_path):
    data = write_conversations(tmp_path / "convs.jsonl")
    out = tmp_path / "head"
    common = ["--base", "tiny-llama", "--out", str(out), "--data", str(data), "--max-tokens", "4000",
              "--max-len", "160", "--lr", "3e-3", "--batch-tokens", "640", "--log-every", "1", "--save-every", "4",
              "--self-distill", "4", "--distill-new-tokens", "16", "--distill-batch", "2", "--threads", "1"]
    s = main(common + ["--epochs", "3"])
    logs = [h for h in s["history"] if "loss" in h]
    first, last = np.mean([h["loss"] for h in logs[:2]]), np.mean([h["loss"] for h in logs[-2:]])
    assert last < 0.9 * first, (first, last)
    assert s["final"]["dev_sharegpt"]["acc"] > 0.2
    assert s["steps"] == s["planned_steps"] and s["epochs"] == 3

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is True
    from safetensors.torch import load_file
    state = load_file(str(out / "model.safetensors"))
    ckpt = tiny_checkpoint("llama")
    assert set(state) == set(head_tensor_shapes(ckpt.cfg))  # no embedding, no lm_head
    assert all(t.dtype == torch.float16 for t in state.values())
    head_cfg, head_state = load_head(out, ckpt.cfg)
    assert head_cfg.num_layers == 1 and head_cfg.fc_bias
    lines = [json.loads(x) for x in (out / "dev_prompts.jsonl").read_text().splitlines()]
    assert lines and all(x["prompt"] for x in lines)

    # A longer schedule resumed from the last checkpoint reuses the cached features; the training-time
    # test (--unroll) trains through the head's own features.
    s2 = main(common + ["--epochs", "4", "--resume", "--unroll", "2"])
    assert 0 <= s2["final"]["dev_sharegpt"]["acc_2"] <= 1 and "acc_3" in s2["final"]["dev_sharegpt"]
    assert s2["stats"]["extract_train"]["tokens"] == 0 and s2["stats"]["distill_train"]["generated"] == 0
    assert s2["steps"] > s["steps"]
    assert [h for h in s2["history"] if "loss" in h][0]["step"] == 1  # history carried over


def test_snapshots_and_their_tau_curve(tmp_path):
    """--snapshots N keeps the head at the start and at N points of training, with the tokens trained
    on; tools.tau_curve exports each with the base and measures tau by category on it."""
    from tools import tau_curve
    data = write_conversations(tmp_path / "convs.jsonl")
    out = tmp_path / "head"
    s = main(["--base", "tiny-llama", "--out", str(out), "--data", str(data), "--max-tokens", "3000",
              "--max-len", "160", "--lr", "3e-3", "--batch-tokens", "640", "--threads", "1", "--epochs", "2",
              "--snapshots", "2"])
    points = tau_curve.snapshots(out)
    assert [info["step"] for _, info in points] == [0, s["steps"] // 2, s["steps"]]
    tokens = [info["trained_tokens"] for _, info in points]
    assert tokens[0] == 0 and tokens[-1] == 2 * s["train_tokens"] and tokens[0] < tokens[1] < tokens[2]
    # the last snapshot is the head the run saved
    assert (points[-1][0] / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    report = tmp_path / "tau.md"
    assert tau_curve.main([str(out), "--base", "tiny-llama", "--precision", "fp32", "--prompts", "builtin",
                           "--trees", "4/2/2", "--max-new-tokens", "6", "--report", str(report),
                           "--json", str(tmp_path / "tau.json"), "--plot", str(tmp_path / "tau.png")]) == 0
    result = json.loads((tmp_path / "tau.json").read_text())["points"]
    assert [p["step"] for p in result] == [info["step"] for _, info in points]
    assert all(1.0 <= p["tau"]["4/2/2"]["all"] <= 3.0 for p in result)
    assert (tmp_path / "tau.png").stat().st_size > 0
    table = report.read_text().splitlines()
    assert "| tree | builtin | all |" in table[2] and len([r for r in table if "| 4/2/2 |" in r]) == 3


def test_schedule_and_batches():
    from training.batches import epoch_batches
    from training.loop import lr_at
    assert lr_at(0.0, 0.05, 1e-3) > 0
    assert lr_at(0.05, 0.05, 1e-3) == pytest.approx(1e-3)
    assert lr_at(1.0, 0.05, 1e-3) == pytest.approx(1e-4)
    lrs = [lr_at(p / 100, 0.05, 1e-3) for p in range(5, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    lengths = np.random.default_rng(0).integers(20, 500, 300)
    batches = epoch_batches(lengths, 1024, 0)
    assert sorted(i for b in batches for i in b) == list(range(300))
    assert all(len(b) * max(lengths[i] for i in b) <= 1024 or len(b) == 1 for b in batches)
    assert epoch_batches(lengths, 1024, 0) == batches != epoch_batches(lengths, 1024, 1)


def test_time_budget_keeps_what_fits(tmp_path):
    data = write_conversations(tmp_path / "convs.jsonl", n=40)
    out = tmp_path / "head"
    s = main(["--base", "tiny-llama", "--out", str(out), "--data", str(data), "--max-tokens", "8000",
              "--max-len", "160", "--extract-batch-tokens", "320", "--batch-tokens", "640", "--epochs", "1",
              "--time-budget", "0.000001", "--threads", "1"])
    assert s["stats"]["extract_train"]["stopped_early"]
    assert 0 < s["train_sequences"]
    load_head(out, tiny_checkpoint("llama").cfg)


def test_more_data_reuses_cached_features_and_init_starts_from_a_head(tmp_path, monkeypatch):
    # Prompts are length-sorted within pools; the first run's 8 prompts fill one whole pool, so
    # the second run's 16 keep them first.
    monkeypatch.setattr("training.features.DISTILL_POOL", 8)
    data = write_conversations(tmp_path / "convs.jsonl", n=40)
    out = tmp_path / "head"
    common = ["--base", "tiny-llama", "--out", str(out), "--data", str(data), "--max-len", "160",
              "--extract-batch-tokens", "320", "--batch-tokens", "640", "--distill-new-tokens", "12",
              "--distill-batch", "2", "--log-every", "1", "--threads", "1", "--lr", "3e-3"]
    s1 = main(common + ["--max-tokens", "2000", "--self-distill", "8", "--epochs", "2"])
    shards = {p.name: p.stat().st_mtime_ns for p in (out / "cache").glob("*.safetensors")}

    # More self-distilled replies, in batches of another size: the cached features and replies
    # are kept (the first run's prompts come first); only the new replies are generated.
    s2 = main(common + ["--max-tokens", "2000", "--self-distill", "16", "--distill-batch", "3", "--epochs", "1",
                        "--init", str(out)])
    assert s2["stats"]["extract_train"]["tokens"] == s2["stats"]["extract_dev"]["tokens"] == 0
    assert 0 < s2["stats"]["distill_train"]["generated"]
    assert s2["train_sequences"] == s1["train_sequences"] + 8
    unchanged = [n for n, t in shards.items() if (out / "cache" / n).stat().st_mtime_ns == t]
    assert sorted(unchanged) == sorted(shards)
    # Without --self-distill, cached replies stay out of the training data.
    s3 = main(common + ["--max-tokens", "2000", "--epochs", "1"])
    assert s3["train_sequences"] == s1["train_sequences"] - 8

    # --init starts from the given head: its first loss is near where the first run ended, not
    # where a fresh head starts.
    l1 = [h["loss"] for h in s1["history"] if "loss" in h]
    l2 = [h["loss"] for h in s2["history"] if "loss" in h]
    assert l2[0] < l1[-1] + 0.25 * (l1[0] - l1[-1]), (l1, l2)


def test_unrolled_steps_see_what_a_drafted_chain_sees():
    """Step j at position p of the training-time test equals drafting a chain at inference: the head
    runs over the verified prefix 0..p-j+1 with true features, then feeds each output back as the
    next node's feature, one cached position at a time."""
    cfg = head_config(tiny_checkpoint("llama").cfg)
    gen = torch.Generator().manual_seed(3)
    head = EagleHead(cfg, 64)
    randomize(head, gen)
    n = 9
    tok = torch.randn(1, n, cfg.hidden_size, generator=gen)
    feats = torch.randn(1, n, cfg.hidden_size, generator=gen)
    with torch.no_grad():
        steps = list(unrolled_forward(head, tok, feats, 3))
        for j in (2, 3):
            for p in range(j - 1, n):
                last = p - j + 1  # the last verified position
                cache = new_cache(cfg, n, 1, "cpu", layers=1)
                prefix = torch.arange(last + 1)[None]
                out = head(tok[:, :last + 1], feats[:, :last + 1], prefix, causal_bias(last + 1), cache, 0)[:, -1:]
                for q in range(last + 1, p + 1):
                    out = head(tok[:, q:q + 1], out, torch.tensor([[q]]), causal_bias(1, q), cache, q)
                torch.testing.assert_close(steps[j - 1][:, p], out[:, 0], rtol=1e-3, atol=1e-4)


def test_replies_made_by_the_engine_train_a_head(tmp_path, capsys):
    """training.distill: greedy replies of the ONNX engine, several side by side, equal to generate()
    alone, written to a compact file that an interrupted run continues; the trainer's --replies takes
    them (reply tokens masked in, held-out conversations left out) and extracts their features."""
    import runtime
    from export.onnx_export import export_onnx
    from models.registry import load_checkpoint
    from training import distill
    from training.replies import read
    data = write_conversations(tmp_path / "convs.jsonl", n=30)
    artifact = tmp_path / "tiny"
    export_onnx(load_checkpoint("tiny-llama"), artifact, "fp32", 256, verify=False, log=lambda m: None)
    out = tmp_path / "replies.npz"
    args = [str(artifact), "--out", str(out), "--data", str(data), "--max-new-tokens", "12", "--parallel", "3",
            "--chunk", "4"]
    assert distill.main(args + ["--n", "4"]) == 0
    assert distill.main(args + ["--n", "9"]) == 0  # continues after the first four
    r = read(out)
    assert len(r["replies"]) == 9 and r["manifest"]["replies"] == 9 and r["manifest"]["precision"] == "fp32"
    assert not any(is_dev(c, 2.0) for c in r["conversation_ids"])
    gen = runtime.load(artifact)
    for prompt, reply in zip(r["prompts"], r["replies"]):
        assert gen.generate(prompt, max_new_tokens=12).token_ids == reply
    with pytest.raises(SystemExit):
        distill.main(args + ["--n", "9", "--max-new-tokens", "8"])  # other settings, same file
    # The trainer's own torch loop on the same weights gives the same replies.
    assert distill.main([str(artifact), "--data", str(data), "--n", "3", "--max-new-tokens", "8", "--parallel", "3",
                         "--against-torch", "tiny-llama", "--torch-batch", "2"]) == 0
    assert "same replies 3 of 3" in capsys.readouterr().out

    head = tmp_path / "head"
    s = main(["--base", "tiny-llama", "--out", str(head), "--data", str(data), "--max-tokens", "1000",
              "--max-len", "160", "--batch-tokens", "640", "--epochs", "1", "--threads", "1",
              "--replies", str(out)])
    assert s["stats"]["extract_replies"]["tokens"] == sum(len(p) + len(q) for p, q in zip(r["prompts"], r["replies"]))
    # FILE@START: the replies from the START-th on (those added since a head was trained)
    later = read_replies([replies_file(f"{out}@4")], 2.0, 160)
    assert [e.id for e in later] == r["conversation_ids"][4:]


def test_longer_prompts_are_taken_apart_from_those_an_earlier_file_took(tmp_path):
    """training.distill --min-prompt: the prompts an earlier file skipped as longer than its
    --max-prompt, and only those; a file made before the setting existed continues as made with 0."""
    import runtime
    from export.onnx_export import export_onnx
    from models.registry import load_checkpoint
    from training import distill
    from training.replies import read, write
    data = write_conversations(tmp_path / "convs.jsonl", n=30)
    artifact = tmp_path / "tiny"
    export_onnx(load_checkpoint("tiny-llama"), artifact, "fp32", 256, verify=False, log=lambda m: None)
    gen = runtime.load(artifact)
    every = distill.prompts(gen, str(data), 0, 100, 256, 2.0, 0)
    cut = sorted(len(q) for _, q in every)[len(every) // 2]
    short = distill.prompts(gen, str(data), 0, 100, cut, 2.0, 0)
    longer = distill.prompts(gen, str(data), 0, 100, 256, 2.0, 0, min_prompt=cut)
    gen.close()
    assert short and longer and all(len(q) > cut for _, q in longer)
    assert sorted(short + longer, key=every.index) == every
    common = [str(artifact), "--data", str(data), "--max-new-tokens", "6", "--parallel", "2", "--chunk", "2"]
    out = tmp_path / "long.npz"
    assert distill.main(common + ["--out", str(out), "--min-prompt", str(cut), "--n", "2"]) == 0
    r = read(out)
    assert r["conversation_ids"] == [c for c, _ in longer[:2]] and r["manifest"]["min_prompt"] == cut
    # A file from before --min-prompt: its manifest has no such entry, and it goes on without one.
    old = tmp_path / "old.npz"
    assert distill.main(common + ["--out", str(old), "--n", "2"]) == 0
    r = read(old)
    write(old, {k: v for k, v in r["manifest"].items() if k != "min_prompt"}, r["conversation_ids"],
          r["prompts"], r["replies"])
    assert distill.main(common + ["--out", str(old), "--n", "3"]) == 0
    assert len(read(old)["replies"]) == 3
    assert json.loads(old.with_suffix(".json").read_text())["min_prompt"] == 0


def test_second_turns_continue_the_conversations_after_the_first_replies(tmp_path):
    """training.distill --after: the second user turn of a first-turn file's conversations, after the
    first turn and the base's own complete reply (replies cut at the token limit are left out), and
    the engine's greedy replies to them."""
    import runtime
    from export.onnx_export import export_onnx
    from models.registry import load_checkpoint
    from models.train_data import first_turn, read_conversations
    from training import distill
    from training.replies import FORMAT, read, write
    data = write_conversations(tmp_path / "convs.jsonl", n=16)
    artifact = tmp_path / "tiny"
    export_onnx(load_checkpoint("tiny-llama"), artifact, "fp32", 512, verify=False, log=lambda m: None)
    gen = runtime.load(artifact)
    firsts = distill.prompts(gen, str(data), 0, 6, 256, 2.0, 0)
    answer = gen.tokenizer.encode("a short answer", add_special_tokens=False)
    stop = gen.manifest["stop_token_ids"][0]
    replies = [answer + [stop] if k % 3 else answer for k in range(len(firsts))]  # every third one cut short
    first = tmp_path / "first.npz"
    write(first, {"format": FORMAT, "vocab_size": gen.manifest["model"]["config"]["vocab_size"],
                  "artifact_sha256": gen.manifest["files"]["weights.bin"]},
          [c for c, _ in firsts], [q for _, q in firsts], replies)
    second = tmp_path / "second.npz"
    assert distill.main([str(artifact), "--out", str(second), "--data", str(data), "--after", str(first), "--n", "10",
                         "--max-new-tokens", "8", "--parallel", "2", "--max-prompt", "512"]) == 0
    r = read(second)
    assert r["conversation_ids"] == [c for k, (c, _) in enumerate(firsts) if k % 3]
    assert r["manifest"]["after"] == "first.npz" and "second user turn" in r["manifest"]["prompts"]
    convs = {c.id: c for c in read_conversations(str(data))}
    for cid, prompt, reply in zip(r["conversation_ids"], r["prompts"], r["replies"]):
        conv = convs[cid]
        user2 = [m for m in conv.messages if m["role"] == "user"][1]
        want = first_turn(conv) + [{"role": "assistant", "content": "a short answer"}, user2]
        assert prompt == gen.tokenizer.apply_chat_template(want)
        assert reply == gen.generate(prompt, max_new_tokens=8).token_ids
    gen.close()


def test_bf16_trains_on_features_cached_apart(tmp_path):
    """--bf16 extracts features and takes training steps with bf16 matmuls: its features are cached
    apart from fp32 ones (they differ), close to them, and the loss falls as in fp32."""
    from models.cpu import bf16_matmuls
    data = write_conversations(tmp_path / "convs.jsonl")
    out = tmp_path / "head"
    common = ["--base", "tiny-llama", "--out", str(out), "--data", str(data), "--max-tokens", "4000",
              "--max-len", "160", "--lr", "3e-3", "--batch-tokens", "640", "--log-every", "1", "--threads", "1",
              "--epochs", "3"]
    if not bf16_matmuls():
        with pytest.raises(SystemExit, match="neither AMX nor AVX512-BF16"):
            main(common + ["--bf16"])
        pytest.skip("this CPU has no bf16 matmuls: --bf16 is refused (checked)")
    from safetensors.numpy import load_file
    fp32 = main(common)
    fp32_features = load_file(str(next((out / "cache").glob("train-*.safetensors"))))
    bf16 = main(common + ["--bf16"])
    assert bf16["stats"]["extract_train"]["tokens"] == fp32["stats"]["extract_train"]["tokens"] > 0  # recomputed
    bf16_features = load_file(str(next((out / "cache").glob("train-*.safetensors"))))
    a, b = (f[k].astype(np.float32) for f, k in ((fp32_features, "hidden"), (bf16_features, "hidden")))
    assert a.shape == b.shape and not np.array_equal(a, b)
    assert np.abs(a - b).mean() < 0.05 * np.abs(a).mean()
    losses = [[h["loss"] for h in s["history"] if "loss" in h] for s in (fp32, bf16)]
    assert losses[1][-1] < 0.9 * losses[1][0]
    assert abs(losses[1][-1] - losses[0][-1]) < 0.1 * losses[0][0]


@pytest.mark.parametrize("name", ["distilled-sharegpt.npz", "distilled-sharegpt-turn2.npz",
                                  "distilled-sharegpt-long.npz"])
def test_committed_replies_match_their_manifest(name):
    """The committed self-distilled replies read back as their manifest says: its counts, training
    conversations only, prompts within its lengths, token ids of the base's vocabulary."""
    from pathlib import Path

    from training.replies import read
    path = Path(__file__).parents[1] / "models" / "heads" / "smollm2-135m" / name
    r = read(path)
    m = r["manifest"]
    assert len(r["replies"]) == len(r["prompts"]) == len(r["conversation_ids"]) == m["replies"]
    assert sum(map(len, r["replies"])) == m["reply_tokens"]
    assert not any(is_dev(c, m["dev_percent"]) for c in r["conversation_ids"])
    assert all(m.get("min_prompt", 0) < len(q) <= m["max_prompt"] for q in r["prompts"])
    assert max(max(q) for q in r["prompts"] + r["replies"] if q) < m["vocab_size"]
    assert m == json.loads(path.with_suffix(".json").read_text())


def test_cached_features_are_read_through_memory_maps_across_shards(tmp_path):
    """load_splits keeps the features on disk (ShardRows) and gives back each sequence's rows as
    written, for sequences in either shard, in batches as in memory."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 100, n) for n in (5, 9, 3, 7)]
    feats = [rng.standard_normal((len(x), 6)).astype(np.float16) for x in seqs]
    masks = [np.ones(len(x), np.uint8) for x in seqs]
    for k, part in enumerate((slice(0, 2), slice(2, 4))):
        save_shard(tmp_path / f"train-{k:05d}.safetensors", seqs[part], masks[part], feats[part], {"count": 2})
    data = load_splits(tmp_path, "train", None)
    assert isinstance(data["hidden"], ShardRows) and data["hidden"].shape == (24, 6)
    for i, f in enumerate(feats):
        a = int(data["offsets"][i])
        assert np.array_equal(data["hidden"][a:a + len(f)].numpy(), f)
        assert np.array_equal(data["ids"][a:a + len(f)].numpy(), seqs[i])
    batch = Batch(data, [1, 3], "cpu")
    assert torch.equal(batch.hidden[1, :7], torch.from_numpy(feats[3]).float())
