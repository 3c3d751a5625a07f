"""The artifact directory: manifest contents, checksums, atomic creation, shared weights."""
from __future__ import annotations

import hashlib
import json
import platform
import shutil
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import transformers

from artifact.manifest import FORMAT, FORMAT_VERSION, ArtifactError, read_manifest
from export.common import DEFAULT_TREE, TREE_POSITION_MARGIN
from export.onnx_export import default_attention, export_onnx
from export.onnx_graph import KERNEL_DOMAIN
from export.onnx_writer import IR_VERSION, OPSET, WEIGHTS_FILE, WeightStore
from export.verify import ParityError
from models.config import ModelConfig
from models.registry import load_checkpoint
from runtime.tuning import TUNING_FILE

MODELS = ["tiny-llama", "tiny-qwen2"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


# --- manifest contents -----------------------------------------------------------------------------

def expected_specs(cfg: ModelConfig, head: bool, precision: str = "fp32") -> dict:
    """An export of this precision with an int8 draft, with this machine's default attention
    (export.onnx_export.default_attention). Both graphs' exact or kernel attention holds the caches of S sequences and
    takes a step's rows regrouped by sequence (row_gather: M rows each, row_scatter back), each row
    written at its own sequence's position (cache_sequences, cache_slots)."""
    kernel = default_attention(precision) == "kernel"
    step = [("input_ids", "int64", [1, "T"]), ("position_ids", "int64", [1, "T"]),
            ("attention_bias", "float32", ["S", 1, "M", "total"]), ("logit_rows", "int64", ["R"])]
    slots = [("row_gather", "int64", ["SM"]), ("row_scatter", "int64", ["T"]), ("cache_sequences", "int64", ["T"]),
             ("cache_slots", "int64", ["T"])]

    def cache(prefix, n, dtype="float32"):
        """The exact attention's value rows carry one more column (ones: the softmax denominator), stored
        in chunks of at most 16 columns: 33 as 3 x 11 for these heads of 32. The kernel's are the
        values themselves, in fp16 beside quantized weights (the int8 draft's)."""
        heads = {"key": cfg.num_kv_heads, "value": cfg.num_kv_heads * (1 if kernel else 3)}
        width = {"key": cfg.head_dim, "value": cfg.head_dim if kernel else 11}
        return [(f"{prefix}_{kind}_{i}", dtype, ["sequences", heads[kind], "max_length", width[kind]])
                for i in range(n) for kind in ("key", "value")]

    base_cache, draft_cache = ("float16" if kernel and p != "fp32" else "float32" for p in (precision, "int8"))

    specs = {"base": {"file": "base.onnx", "inputs": step + cache("past", cfg.num_layers, base_cache) + slots,
                      "outputs": [("logits", "float32", [1, "R", cfg.vocab_size]),
                                  ("hidden_states", "float32", [1, "T", cfg.hidden_size])]
                      + cache("present", cfg.num_layers, base_cache)}}
    if head:
        specs["draft"] = {"file": "draft.onnx",
                          "inputs": step + cache("past", 1, draft_cache) + slots
                          + [("features", "float32", [1, "T", cfg.hidden_size]), ("top_k", "int64", [1])],
                          "outputs": [("hidden_states", "float32", [1, "T", cfg.hidden_size]),
                                      ("topk_ids", "int64", [1, "R", "k"]),
                                      ("topk_logprobs", "float32", [1, "R", "k"])] + cache("present", 1, draft_cache)}
    return {g: {"file": s["file"],
                "inputs": [{"name": n, "dtype": d, "shape": sh} for n, d, sh in s["inputs"]],
                "outputs": [{"name": n, "dtype": d, "shape": sh} for n, d, sh in s["outputs"]]}
            for g, s in specs.items()}


@pytest.mark.parametrize("name", MODELS)
def test_default_int8_draft_of_an_fp32_base_quantizes_the_base_lm_head(tiny_artifact, name):
    """The default CPU draft is 8-bit: it shares the fp32 embedding and holds the 8-bit
    quantization of the base's own lm_head (declared as draft_precision in the manifest)."""
    from export.onnx_graph import INT8_BLOCK
    from export.quantize import quantize_8bit
    artifact = tiny_artifact(name, "fp32")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert (manifest["precision"], manifest["draft_precision"]) == ("fp32", "int8")
    base, draft = initializers(artifact / "base.onnx"), initializers(artifact / "draft.onnx")
    emb_b, emb_d = external(base["model.embed_tokens.weight"]), external(draft["model.embed_tokens.weight"])
    assert (emb_b["offset"], emb_b["length"]) == (emb_d["offset"], emb_d["length"])
    ckpt = load_checkpoint(name)
    lm = "model.embed_tokens" if ckpt.cfg.tie_word_embeddings else "lm_head"
    q = external(draft[f"{lm}.q8"])
    with open(artifact / WEIGHTS_FILE, "rb") as f:
        f.seek(int(q["offset"]))
        stored = np.frombuffer(f.read(int(q["length"])), np.uint8)
    weight = ckpt.state.get("lm_head.weight", ckpt.state["model.embed_tokens.weight"]).numpy()
    np.testing.assert_array_equal(stored, quantize_8bit(weight, INT8_BLOCK)[0].ravel())


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("name", MODELS)
def test_manifest_contents(tiny_artifact, name, precision):
    artifact = tiny_artifact(name, precision)
    ckpt = load_checkpoint(name)
    m = json.loads((artifact / "manifest.json").read_text())

    assert m["format"] == FORMAT == "eagle2-onnx"
    assert m["format_version"] == FORMAT_VERSION == 1
    assert m["target"] == "onnx"
    assert m["precision"] == precision
    attention = default_attention(precision)
    assert (m["attention"], m["exact_key_block"]) == (attention, 1024 if attention == "exact" else None)
    assert m["io_dtype"] == "float32"
    # Architecture and sizes, exactly the checkpoint's config.
    assert ModelConfig.from_dict(m["model"]["config"]) == ckpt.cfg
    c = m["model"]["config"]
    assert (c["model_type"], c["vocab_size"], c["hidden_size"], c["num_layers"], c["num_heads"], c["num_kv_heads"],
            c["head_dim"]) == (name.removeprefix("tiny-"), 259, 128, 2, 4, 2, 32)
    assert m["model"]["source"] == ckpt.source
    # Head source and config.
    assert m["head"]["source"] == ckpt.head_source == "random (seed 0)"
    assert ModelConfig.from_dict(m["head"]["config"]).hidden_size == ckpt.cfg.hidden_size
    # Lengths: the default max length, plus the rotary margin for tree nodes past the context.
    assert m["max_length"] == min(2048, ckpt.cfg.max_position_embeddings) == 2048
    assert m["rotary_positions"] == m["max_length"] + TREE_POSITION_MARGIN
    # Graph inputs/outputs: names, dtypes, shapes.
    assert m["graphs"] == expected_specs(ckpt.cfg, head=True, precision=precision)
    # Default tree parameters for the precision (small trees on CPU).
    assert m["tree_defaults"] == DEFAULT_TREE[precision] == {"total_tokens": 3, "depth": 1, "top_k": 2}
    # Stop tokens: the eos (<|im_end|>) and <|endoftext|>, inside the vocabulary.
    vocab = ckpt.tokenizer.get_vocab()
    assert m["stop_token_ids"] == sorted({vocab["<|im_end|>"], vocab["<|endoftext|>"], *ckpt.cfg.eos_token_ids})
    assert m["tokenizer"] == "tokenizer" and (artifact / "tokenizer" / "tokenizer.json").is_file()
    # Versions of what produced it.
    assert m["versions"] == {"exporter": version("eagle2-deploy"), "onnx": onnx.__version__,
                             "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
                             "transformers": transformers.__version__, "python": platform.python_version()}
    assert set(m["parity"]) >= {"base.logits", "draft.topk_logprobs"}
    assert isinstance(m["export_seconds"], (int, float)) and m["export_seconds"] >= 0


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_manifest_checksums_cover_every_file(tiny_artifact, precision):
    artifact = tiny_artifact("tiny-llama", precision)
    m = read_manifest(artifact)
    on_disk = {str(p.relative_to(artifact)) for p in artifact.rglob("*") if p.is_file()}
    # tuning.json is this machine's (runtime/tuning.py), written by loads and tunes after the export.
    assert set(m["files"]) == on_disk - {"manifest.json", TUNING_FILE}
    assert {"base.onnx", "draft.onnx", "weights.bin", "tokenizer/tokenizer.json",
            "tokenizer/tokenizer_config.json", "tokenizer/chat_template.jinja"} <= set(m["files"])
    for name, digest in m["files"].items():
        assert sha256(artifact / name) == digest, name


@pytest.mark.parametrize("name", MODELS)
def test_manifest_specs_match_the_graph_files(tiny_artifact, name):
    artifact = tiny_artifact(name, "fp32")
    m = read_manifest(artifact)
    for spec in m["graphs"].values():
        model = onnx.load(str(artifact / spec["file"]), load_external_data=False)
        assert [v.name for v in model.graph.input] == [i["name"] for i in spec["inputs"]]
        assert [v.name for v in model.graph.output] == [o["name"] for o in spec["outputs"]]
        assert model.ir_version == IR_VERSION
        own = {(KERNEL_DOMAIN, 1)} if m["attention"] == "kernel" else set()  # this project's attention operator
        assert {(o.domain, o.version) for o in model.opset_import} == {("", OPSET), ("com.microsoft", 1)} | own


def test_manifest_without_head_and_with_max_length(tiny_artifact):
    artifact = tiny_artifact("tiny-qwen2", "fp32", head=False, max_length=64)
    m = read_manifest(artifact)
    assert m["head"] is None
    assert set(m["graphs"]) == {"base"} and not (artifact / "draft.onnx").exists()
    assert m["max_length"] == 64 and m["rotary_positions"] == 64 + TREE_POSITION_MARGIN
    assert set(m["parity"]) == {"base.logits", "base.hidden_states", "base.kv_cache"}
    assert m["graphs"] == expected_specs(load_checkpoint("tiny-qwen2").cfg, head=False)


def test_no_verify_leaves_parity_out(tmp_path, export_cli):
    rc, _, err = export_cli("tiny-llama", "--no-verify", "--precision", "int8", "--out", tmp_path / "a")
    assert rc == 0, err
    m = read_manifest(tmp_path / "a")
    assert "parity" not in m and m["precision"] == "int8"


# --- read_manifest refuses broken artifacts --------------------------------------------------------

@pytest.fixture
def artifact_copy(tiny_artifact, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_artifact("tiny-llama", "fp32"), tmp_path / "artifact"))


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_manifest(root: Path, **changes) -> None:
    m = json.loads((root / "manifest.json").read_text())
    m.update(changes)
    (root / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("file", ["weights.bin", "base.onnx", "draft.onnx", "tokenizer/tokenizer.json"])
def test_read_manifest_rejects_a_tampered_file(artifact_copy, file):
    read_manifest(artifact_copy)  # intact copy: fine
    flip_byte(artifact_copy / file, (artifact_copy / file).stat().st_size // 2)
    with pytest.raises(ArtifactError, match=f"checksum mismatch for {file}"):
        read_manifest(artifact_copy)
    read_manifest(artifact_copy, verify_checksums=False)  # the caller may opt out of hashing


@pytest.mark.parametrize("file", ["draft.onnx", "weights.bin", "tokenizer/tokenizer.json"])
def test_read_manifest_rejects_a_missing_file(artifact_copy, file):
    (artifact_copy / file).unlink()
    for verify in (True, False):
        with pytest.raises(ArtifactError, match=f"is missing {file}"):
            read_manifest(artifact_copy, verify_checksums=verify)


@pytest.mark.parametrize("other", [0, 2, "1", None])
def test_read_manifest_rejects_another_format_version(artifact_copy, other):
    edit_manifest(artifact_copy, format_version=other)
    with pytest.raises(ArtifactError, match=rf"format version {other} is not supported .*re-export"):
        read_manifest(artifact_copy)


def test_read_manifest_rejects_another_format(artifact_copy):
    edit_manifest(artifact_copy, format="something-else")
    with pytest.raises(ArtifactError, match="format 'something-else' is not 'eagle2-onnx'"):
        read_manifest(artifact_copy)


def test_read_manifest_rejects_corrupt_or_missing_manifest(artifact_copy):
    (artifact_copy / "manifest.json").write_text('{"format": ')
    with pytest.raises(ArtifactError, match="manifest.json is corrupt"):
        read_manifest(artifact_copy)
    (artifact_copy / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="not an artifact directory .*python -m export"):
        read_manifest(artifact_copy)


# --- a failed or interrupted export leaves nothing -------------------------------------------------

class Boom(RuntimeError):
    pass


def fail(exc):
    def raiser(*args, **kwargs):
        raise exc
    return raiser


FAILURE_POINTS = {
    "build_graph": ("export.onnx_export.build_draft", Boom("boom")),
    "write_weights": ("export.onnx_writer.WeightStore.tensor", Boom("boom")),
    "save_tokenizer": ("export.onnx_export.save_tokenizer", Boom("boom")),
    "parity_check": ("export.verify.check_parity", Boom("boom")),
    "write_manifest": ("export.common.write_manifest", Boom("boom")),
}


@pytest.mark.parametrize("point", FAILURE_POINTS)
def test_failed_export_leaves_no_directory(point, tmp_path, monkeypatch):
    target, exc = FAILURE_POINTS[point]
    monkeypatch.setattr(target, fail(exc))
    parent = tmp_path / "outs"
    parent.mkdir()
    with pytest.raises(Boom):
        export_onnx(load_checkpoint("tiny-llama"), parent / "artifact", "fp32", log=lambda m: None)
    assert leftovers(parent) == []


@pytest.mark.parametrize("point", ["save_tokenizer", "parity_check", "write_manifest"])
def test_interrupted_cli_export_leaves_no_directory(point, tmp_path, monkeypatch, export_cli):
    target, _ = FAILURE_POINTS[point]
    monkeypatch.setattr(target, fail(KeyboardInterrupt()))
    parent = tmp_path / "outs"
    parent.mkdir()
    rc, _, err = export_cli("tiny-llama", "--out", parent / "artifact")
    assert rc == 130
    assert "interrupted: nothing was written" in err
    assert leftovers(parent) == []


def test_parity_failure_through_cli_leaves_no_directory(tmp_path, monkeypatch, export_cli):
    monkeypatch.setattr("export.verify.check_parity", fail(ParityError("fp32 graphs differ: base.logits 0.5")))
    parent = tmp_path / "outs"
    parent.mkdir()
    rc, _, err = export_cli("tiny-llama", "--out", parent / "artifact")
    assert rc == 1
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: fp32 graphs differ: base.logits 0.5"]
    assert leftovers(parent) == []


def test_failed_forced_export_keeps_the_old_artifact(tiny_artifact, tmp_path, monkeypatch, export_cli):
    parent = tmp_path / "outs"
    parent.mkdir()
    old = Path(shutil.copytree(tiny_artifact("tiny-llama", "fp32"), parent / "artifact"))
    before = read_manifest(old)
    monkeypatch.setattr("export.onnx_export.save_tokenizer", fail(KeyboardInterrupt()))
    rc, _, err = export_cli("tiny-qwen2", "--out", old, "--force")
    assert rc == 130
    assert leftovers(parent) == ["artifact"]
    assert read_manifest(old) == before  # still the old artifact, every checksum intact


def test_forced_export_replaces_an_artifact(tiny_artifact, tmp_path, export_cli):
    parent = tmp_path / "outs"
    parent.mkdir()
    old = Path(shutil.copytree(tiny_artifact("tiny-llama", "fp32"), parent / "artifact"))
    rc, _, err = export_cli("tiny-qwen2", "--no-head", "--max-length", "32", "--out", old, "--force")
    assert rc == 0, err
    assert leftovers(parent) == ["artifact"]  # no .artifact.old-* / .partial-* left
    m = read_manifest(old)
    assert m["model"]["config"]["model_type"] == "qwen2" and m["head"] is None
    assert not (old / "draft.onnx").exists()


# --- one copy of every weight: the draft uses the base's embedding and lm_head ---------------------

def external(tensor: onnx.TensorProto) -> dict:
    assert tensor.data_location == onnx.TensorProto.EXTERNAL, tensor.name
    return {e.key: e.value for e in tensor.external_data}


def initializers(path: Path) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("name", MODELS)
def test_draft_shares_embedding_and_lm_head_bytes_with_base(tiny_artifact, name, precision):
    """With the draft in the base's precision, both graphs read the very same bytes."""
    artifact = tiny_artifact(name, precision, draft_precision=precision)
    base, draft = initializers(artifact / "base.onnx"), initializers(artifact / "draft.onnx")
    ckpt = load_checkpoint(name)
    lm = "model.embed_tokens" if ckpt.cfg.tie_word_embeddings else "lm_head"
    shared = ["model.embed_tokens.weight"] + ([f"{lm}.weight"] if precision == "fp32" else
                                              [f"{lm}.q8", f"{lm}.scales"])
    for tensor_name in dict.fromkeys(shared):
        assert tensor_name in base and tensor_name in draft, tensor_name
        b, d = external(base[tensor_name]), external(draft[tensor_name])
        assert b["location"] == d["location"] == WEIGHTS_FILE
        assert (b["offset"], b["length"]) == (d["offset"], d["length"]), tensor_name
        assert list(base[tensor_name].dims) == list(draft[tensor_name].dims)
    # The draft's vocabulary projection consumes exactly that shared tensor.
    lm_inputs = {i for n in onnx.load(str(artifact / "draft.onnx"), load_external_data=False).graph.node
                 if n.op_type in ("Gemm", "MatMulNBits") for i in n.input}
    assert shared[-1] in lm_inputs
    # And those bytes are the checkpoint's (the embedding is never quantized).
    emb = external(base["model.embed_tokens.weight"])
    with open(artifact / WEIGHTS_FILE, "rb") as f:
        f.seek(int(emb["offset"]))
        data = np.frombuffer(f.read(int(emb["length"])), np.float32).reshape(ckpt.cfg.vocab_size, -1)
    np.testing.assert_array_equal(data, ckpt.state["model.embed_tokens.weight"].numpy())


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("name", MODELS)
def test_weights_file_holds_each_tensor_once(tiny_artifact, name, precision):
    artifact = tiny_artifact(name, precision)
    by_offset: dict[int, tuple] = {}
    for graph in ("base.onnx", "draft.onnx"):
        for tensor in initializers(artifact / graph).values():
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue  # small constants live in the graph
            e = external(tensor)
            entry = (tensor.name, int(e["length"]))
            assert by_offset.setdefault(int(e["offset"]), entry) == entry, f"{tensor.name} in {graph}"
    spans = sorted((off, off + length) for off, (_, length) in by_offset.items())
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "overlapping tensors"
    size = (artifact / WEIGHTS_FILE).stat().st_size
    assert spans[-1][1] <= size
    # No tensor stored twice: the file is the sum of the distinct tensors (each 4 KiB-aligned).
    assert size == sum(-(-length // 4096) * 4096 for _, length in by_offset.values())
    names = [n for n, _ in by_offset.values()]
    assert len(names) == len(set(names))


def test_weight_store_refuses_two_different_tensors_under_one_name(tmp_path):
    with WeightStore(tmp_path / "w.bin") as store:
        store.tensor("w", np.zeros((2, 2), np.float32))
        store.tensor("w", np.zeros((2, 2), np.float32))  # the same tensor again: shared
        with pytest.raises(ValueError, match="two different tensors named 'w'"):
            store.tensor("w", np.ones((2, 2), np.float32))
    assert (tmp_path / "w.bin").stat().st_size == 4096  # written once, padded to its alignment


def test_failed_export_removes_the_directories_it_created(tmp_path):
    from artifact.directory import atomic_directory
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "new" / "nested" / "out"):
            raise RuntimeError("export failed midway")
    assert list(tmp_path.iterdir()) == []
