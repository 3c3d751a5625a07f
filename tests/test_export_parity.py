"""Exported tiny models against the PyTorch definitions and against transformers' own models.

Each check runs a prefill then a tree step (non-sequential tree positions, a tree attention mask)
through ONNX Runtime with the runtime's in-place cache binding (runtime.session.GraphSession).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from artifact.manifest import read_manifest
from export.common import default_precision
from export import onnx_graph, onnx_writer
from export.verify import TOLERANCE, ParityError, check_parity, random_tree, stored_weights, tree_bias, w8a8_rows
from models.config import ModelConfig
from models.cpu import int8_dot_products
from models.llama import causal_bias
from models.registry import load_checkpoint
from runtime.session import GraphSession
from runtime.tokenizer import ChatTokenizer

MODELS = ["tiny-llama", "tiny-qwen2"]
PRECISIONS = ["fp32", "int8", pytest.param("w8a8", marks=pytest.mark.skipif(
    not int8_dot_products(), reason="w8a8 needs VNNI or AMX, which this CPU lacks"))]
PREFILL, TREE = 12, 16
HF_CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


@dataclass
class Step:
    ids: np.ndarray        # [1, T] int64
    positions: np.ndarray  # [1, T] int64
    bias: np.ndarray       # [1, 1, T, start + T] float32, additive
    rows: np.ndarray       # [R] int64: rows whose logits are wanted
    start: int             # tokens already cached


def prefill_and_tree(vocab: int, seed: int = 1) -> list[Step]:
    rng = np.random.default_rng(seed)
    parents, depth = random_tree(TREE, rng)
    # A real tree: some node has several children, and depths (hence positions) repeat.
    assert len(set(parents[1:].tolist())) < TREE - 1 and depth.max() < TREE - 1
    return [
        Step(rng.integers(0, vocab, (1, PREFILL)), np.arange(PREFILL)[None], causal_bias(PREFILL).numpy(),
             np.array([3, PREFILL - 1]), 0),  # a subset of rows, as in a real prefill
        Step(rng.integers(0, vocab, (1, TREE)), np.ascontiguousarray((PREFILL + depth)[None]),
             tree_bias(parents, PREFILL), np.arange(TREE), PREFILL),
    ]


def run_base_graph(artifact, steps: list[Step]):
    """[(logits [R, V], hidden [T, H])] per step, and {cache input name: array [1, kv, P+T, D]}."""
    manifest = read_manifest(artifact)
    spec = manifest["graphs"]["base"]
    session = GraphSession(str(artifact / spec["file"]), spec, "cpu", PREFILL + TREE + 4, max(PREFILL, TREE))
    outs = []
    for s in steps:
        out = session.run({"input_ids": s.ids, "position_ids": s.positions, "attention_bias": s.bias,
                           "logit_rows": s.rows})
        # The session returns views of buffers that the next step overwrites: copy.
        outs.append((out["logits"][0].copy(), out["hidden_states"][0].copy()))
    used = steps[-1].start + steps[-1].ids.shape[1]
    cfg = manifest["model"]["config"]
    head_dim, kv_heads = cfg["head_dim"], cfg["num_kv_heads"]
    caches = {}
    for name, arr in zip(session.cache_names, session.cache_arrays()):
        # The exact attention's value rows are stored in chunks [1, kv * chunks, length, width]; joined,
        # they end in a column of ones (its softmax denominator), then zeros up to chunks * width.
        chunks = arr.shape[1] // kv_heads
        if chunks > 1:
            arr = arr.reshape(1, kv_heads, chunks, *arr.shape[2:]).transpose(0, 1, 3, 2, 4)
            arr = arr.reshape(1, kv_heads, arr.shape[2], -1)
            np.testing.assert_array_equal(arr[:, :, :used, head_dim], 1.0, err_msg=name)
            np.testing.assert_array_equal(arr[:, :, :used, head_dim + 1:], 0.0, err_msg=name)
        caches[name] = arr[:, :, :used, :head_dim].copy()
    return outs, caches


def hf_model(cfg: ModelConfig, state: dict, precision: str):
    """transformers' own model with the weights the graph holds (8-bit dequantized for int8)."""
    hf = cfg.to_hf()
    if precision == "fp32":
        weights = dict(state)
    else:
        # As in the graph: linear layers and the lm_head dequantized, the embedding exact; so an
        # int8 tied model is untied here.
        weights = stored_weights({k: v for k, v in state.items() if k != "lm_head.weight"}, precision)
        lm = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        weights["lm_head.weight"] = stored_weights({"lm_head.weight": lm}, precision)["lm_head.weight"]
        hf["tie_word_embeddings"] = False
    config_cls, model_cls = HF_CLASSES[hf.pop("model_type")]
    config = config_cls(**hf, attn_implementation="eager")
    model = model_cls(config).eval()
    model.load_state_dict(weights, strict=True)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (cfg.tie_word_embeddings and precision == "fp32")  # transformers read the tie flag
    return model


def run_hf(model, steps: list[Step]):
    """Same steps through transformers: 4-D additive masks, explicit position ids, a DynamicCache."""
    cache = transformers.DynamicCache(config=model.config)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    captured = {}
    # The input of lm_head over all rows: the post-final-norm hidden states, whatever the
    # transformers version puts in outputs.hidden_states.
    hook = model.model.norm.register_forward_hook(lambda mod, args, out: captured.update(hidden=out))
    outs = []
    try:
        with torch.no_grad():
            for s in steps:
                out = model(torch.from_numpy(s.ids), attention_mask=torch.from_numpy(s.bias),
                            position_ids=torch.from_numpy(s.positions), use_cache=True, **{cache_kw: cache})
                outs.append((out.logits[0, s.rows].numpy(), captured["hidden"][0].numpy()))
    finally:
        hook.remove()
    layers = getattr(cache, "layers", None)
    caches = {}
    for i in range(model.config.num_hidden_layers):
        k = layers[i].keys if layers is not None else cache.key_cache[i]
        v = layers[i].values if layers is not None else cache.value_cache[i]
        caches[f"past_key_{i}"], caches[f"past_value_{i}"] = k.numpy(), v.numpy()
    return outs, caches


def rel_diff(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


# --- (a) the exporter's own parity check ---------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", MODELS)
def test_builtin_parity_is_recorded_and_small(tiny_artifact, name, precision):
    manifest = read_manifest(tiny_artifact(name, precision))
    diffs = manifest["parity"]
    rounding = {f"rounding alone: base.{n}" for n in ("logits", "hidden_states", "kv_cache")}
    assert set(diffs) == {"base.logits", "base.hidden_states", "base.kv_cache", "draft.hidden_states",
                          "draft.topk_logprobs"} | (rounding if precision == "w8a8" else set())
    draft = manifest["draft_precision"]
    for part, p in (("base.", precision), ("draft.", draft)):
        part_diffs = [d for n, d in diffs.items() if n.startswith(part)]
        assert all(0 <= d <= TOLERANCE[p] for d in part_diffs), diffs
        if p == "fp32":
            assert max(part_diffs) < 1e-5, diffs  # fp32 graph arithmetic is far inside its tolerance
        else:
            assert max(part_diffs) > 1e-4, f"{part} graph suspiciously exact: is it quantized at all?"


def test_builtin_parity_catches_wrong_weights(tiny_artifact):
    """The check is not vacuous: the same graphs against slightly different weights fail it."""
    artifact = tiny_artifact("tiny-llama", "fp32")
    ckpt = load_checkpoint("tiny-llama")
    state = dict(ckpt.state)
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * 1.01
    with pytest.raises(ParityError, match="base.logits"):
        check_parity(artifact, read_manifest(artifact), ckpt.cfg, state, ckpt.head_cfg, ckpt.head_state)


@pytest.mark.skipif(not int8_dot_products(), reason="w8a8 needs VNNI or AMX, which this CPU lacks")
def test_w8a8_bound_follows_the_rounding_and_still_catches_wrong_weights(tiny_artifact, monkeypatch):
    """A model whose activations' rounding alone exceeds the fixed tolerance (as a deep random one
    does) passes where the graph differs by no more than that rounding, and wrong weights still fail."""
    from export.memory import resident_calibration
    from export.onnx_export import _smoothed
    from models.tensors import fp32_arrays
    artifact = tiny_artifact("tiny-llama", "w8a8")
    ckpt = load_checkpoint("tiny-llama")
    smoothed, _ = _smoothed(ckpt.cfg, fp32_arrays(ckpt.state), ckpt.tokenizer, resident_calibration(ckpt, "onnx", "w8a8", True))
    state = {k: torch.from_numpy(v) for k, v in smoothed.items()}
    monkeypatch.setitem(TOLERANCE, "w8a8", 1e-3)
    diffs = check_parity(artifact, read_manifest(artifact), ckpt.cfg, state, ckpt.head_cfg, ckpt.head_state)
    assert diffs["rounding alone: base.logits"] > 1e-3 and diffs["base.logits"] > 1e-3
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * 1.2
    with pytest.raises(ParityError, match="base.logits"):
        check_parity(artifact, read_manifest(artifact), ckpt.cfg, state, ckpt.head_cfg, ckpt.head_state)


@pytest.mark.skipif(not int8_dot_products(), reason="w8a8 needs VNNI or AMX, which this CPU lacks")
def test_w8a8_reference_rounds_rows_as_the_graph_does(tmp_path):
    """The parity check's w8a8 reference rounds each linear's input rows as the graph does, so it
    checks the graph rather than the rounding's effect: one exported linear agrees with it to fp32
    arithmetic, and with unrounded rows only to the rounding."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((96, 256)).astype(np.float32)
    with onnx_writer.WeightStore(tmp_path / onnx_writer.WEIGHTS_FILE) as store:
        g = onnx_writer.Graph(store)
        g.input("x", onnx.TensorProto.FLOAT, ["T", 256])
        y = onnx_graph.Builder(g, "w8a8", {}).linear("x", "layer.up_proj", weight)
        g.nodes.append(onnx.helper.make_node("Identity", [y], ["y"]))
        g.output("y", onnx.TensorProto.FLOAT, ["T", 96])
        onnx.save(g.model("one_linear", ""), tmp_path / "linear.onnx")
    session = ort.InferenceSession(str(tmp_path / "linear.onnx"), providers=["CPUExecutionProvider"])
    x = (rng.standard_normal((12, 256)) * 3 + 0.5).astype(np.float32)
    got = session.run(None, {"x": x})[0]
    w = stored_weights({"layer.up_proj.weight": torch.from_numpy(weight)}, "w8a8")["layer.up_proj.weight"]
    assert rel_diff(got, w8a8_rows(torch.from_numpy(x)) @ w.T) < 1e-5
    assert rel_diff(got, torch.from_numpy(x) @ w.T) > 1e-3


# --- (b) against transformers ------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", MODELS)
def test_graph_matches_transformers(tiny_artifact, name, precision):
    ckpt = load_checkpoint(name)
    steps = prefill_and_tree(ckpt.cfg.vocab_size)
    got, got_cache = run_base_graph(tiny_artifact(name, precision), steps)
    want, want_cache = run_hf(hf_model(ckpt.cfg, ckpt.state, precision), steps)
    tol = TOLERANCE[precision]
    for label, (g_logits, g_hidden), (w_logits, w_hidden) in zip(("prefill", "tree"), got, want):
        assert rel_diff(g_logits, w_logits) < tol, f"{label} logits"
        assert rel_diff(g_hidden, w_hidden) < tol, f"{label} hidden_states"
        if precision == "fp32":
            np.testing.assert_array_equal(g_logits.argmax(-1), w_logits.argmax(-1), err_msg=f"{label} argmax")
    # The in-place cache holds exactly what transformers' cache holds (rotated keys, values),
    # prompt rows and tree rows alike.
    assert set(got_cache) == set(want_cache)
    for cache_name, want_kv in want_cache.items():
        assert rel_diff(got_cache[cache_name], want_kv) < tol, cache_name


@pytest.mark.parametrize("name", MODELS)
def test_int8_greedy_agrees_with_fp32_on_tree_step(tiny_artifact, name):
    steps = prefill_and_tree(load_checkpoint(name).cfg.vocab_size, seed=2)
    (_, (fp32_logits, _)), _ = run_base_graph(tiny_artifact(name, "fp32"), steps)
    (_, (int8_logits, _)), _ = run_base_graph(tiny_artifact(name, "int8"), steps)
    agreement = float(np.mean(fp32_logits.argmax(-1) == int8_logits.argmax(-1)))
    assert agreement >= 0.8, f"int8 and fp32 greedy tokens agree on only {agreement:.0%} of tree rows"


# --- a local Hugging Face directory as MODEL -----------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_hf_directory_export_matches_alias_export(tiny_hf_dir, tiny_head_dir, tiny_artifact, export_cli,
                                                  tmp_path, name):
    hf_dir, head_dir = tiny_hf_dir(name), tiny_head_dir(name)
    # transformers itself reads the directory (it is a genuine HF checkpoint).
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
    assert hf.config.model_type == name.removeprefix("tiny-")

    out = tmp_path / "from-dir"
    rc, stdout, err = export_cli(hf_dir, "--head", head_dir, "--out", out)
    assert rc == 0, err
    assert "with draft head" in stdout
    alias = tiny_artifact(name, default_precision())  # the CLI default
    got, want = read_manifest(out), read_manifest(alias)

    assert got["model"]["source"] == str(hf_dir)
    assert got["head"]["source"] == str(head_dir)
    assert ModelConfig.from_dict(got["model"]["config"]) == load_checkpoint(name).cfg  # to_hf/from_hf round trip
    for key in ("graphs", "tree_defaults", "stop_token_ids", "max_length", "rotary_positions", "precision"):
        assert got[key] == want[key], key
    # num_layers aside: see test_tiny_head_config_says_one_layer.
    assert {**got["head"]["config"], "num_layers": 1} == {**want["head"]["config"], "num_layers": 1}
    assert got["head"]["config"]["num_layers"] == 1
    # Same weights, same graphs: the very same bytes.
    for f in ("base.onnx", "draft.onnx", "weights.bin"):
        assert got["files"][f] == want["files"][f], f

    steps = prefill_and_tree(got["model"]["config"]["vocab_size"], seed=3)
    got_outs, got_cache = run_base_graph(out, steps)
    want_outs, want_cache = run_base_graph(alias, steps)
    for (gl, gh), (wl, wh) in zip(got_outs, want_outs):
        np.testing.assert_array_equal(gl, wl)
        np.testing.assert_array_equal(gh, wh)
    for cache_name in want_cache:
        np.testing.assert_array_equal(got_cache[cache_name], want_cache[cache_name])

    tok_got, tok_want = ChatTokenizer(out / got["tokenizer"]), ChatTokenizer(alias / want["tokenizer"])
    messages = [{"role": "user", "content": "What is the capital of France? é"}]
    assert tok_got.apply_chat_template(messages) == tok_want.apply_chat_template(messages)
    assert tok_got.encode("hello world") == tok_want.encode("hello world")


def test_tiny_head_config_says_one_layer(tiny_artifact):
    """The manifest's head config describes the head: EAGLE-1/2 heads have one decoder layer."""
    manifest = read_manifest(tiny_artifact("tiny-llama", "fp32"))
    assert manifest["head"]["config"]["num_layers"] == 1
