"""Bad inputs to `python -m export`: a non-zero exit, one clear `error:` line, no traceback, and
nothing left next to the requested output (no artifact, no .NAME.partial-* directory)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from export.common import default_precision
from models.registry import load_checkpoint


def assert_one_error(rc: int, err: str, *phrases: str) -> str:
    assert rc != 0
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for phrase in phrases:
        assert phrase in errors[0], f"{phrase!r} not in {errors[0]!r}"
    return errors[0]


@pytest.fixture
def outs(tmp_path) -> Path:
    """The parent of the requested artifact: must still be empty after a failed export."""
    d = tmp_path / "outs"
    d.mkdir()
    return d


def copy_hf_dir(tiny_hf_dir, tmp_path, name="tiny-llama") -> Path:
    return Path(shutil.copytree(tiny_hf_dir(name), tmp_path / "model"))


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


# --- MODEL cannot be read ------------------------------------------------------------------------

def case_unknown_alias(tmp_path, tiny_hf_dir):
    return ["llama9-70b"], ["unknown model 'llama9-70b'", "--list"]


def case_empty_directory(tmp_path, tiny_hf_dir):
    d = tmp_path / "empty"
    d.mkdir()
    return [d], ["missing config.json", str(d)]


def case_missing_weights(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    (d / "model.safetensors").unlink()
    return [d], ["no weights in", str(d)]


def case_missing_shard(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return [d], ["missing weight shard model-00002-of-00002.safetensors"]


def case_garbage_safetensors(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    return [d], ["cannot read weights from", "model.safetensors"]


def case_truncated_safetensors(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return [d], ["cannot read weights from", "model.safetensors"]


def case_garbage_pytorch_bin(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not a pickle" * 100)
    return [d], ["cannot read weights from", "pytorch_model.bin"]


def case_invalid_config_json(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    (d / "config.json").write_text('{"model_type": "llama",')
    return [d], ["config.json is not valid JSON"]


def case_tensor_of_wrong_shape(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    edit_config(d, intermediate_size=512)  # the weights are for 256
    return [d], ["model.layers.0.mlp.gate_proj.weight", "(256, 128)", "(512, 128)"]


def case_missing_tensor(tmp_path, tiny_hf_dir):
    from safetensors.torch import load_file, save_file
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    state = load_file(str(d / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(d / "model.safetensors"))
    return [d], ["missing tensor 'model.norm.weight'"]


def case_text_file(tmp_path, tiny_hf_dir):
    f = tmp_path / "notes.txt"
    f.write_text("not a model\n")
    return [f], ["is a file, not a model directory or a GGUF file"]


def case_gguf_with_wrong_magic(tmp_path, tiny_hf_dir):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGML" + os.urandom(1024))
    return [f], ["not a GGUF file (bad magic)"]


def case_gguf_with_garbage_after_magic(tmp_path, tiny_hf_dir):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return [f], ["cannot load GGUF", "model.gguf"]


# --- unsupported architectures ---------------------------------------------------------------------

def case_gpt2(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    edit_config(d, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    return [d], ["unsupported architecture 'GPT2LMHeadModel'", "gpt2"]


def case_mistral_sliding_window(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    edit_config(d, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096)
    return [d], ["sliding_window=4096"]


def case_yarn_rope_scaling(tmp_path, tiny_hf_dir):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    return [d], ["unsupported rope scaling 'yarn'"]


# --- the head does not fit -------------------------------------------------------------------------

def case_head_hidden_size_mismatch(tmp_path, tiny_hf_dir, tiny_head_dir):
    head = tiny_head_dir("tiny-llama", hidden_size=64)
    return [tiny_hf_dir("tiny-llama"), "--head", head], ["does not fit the base model",
                                                          "hidden_size is 64 in the head but 128 in the base"]


def case_head_vocab_mismatch(tmp_path, tiny_hf_dir, tiny_head_dir):
    head = tiny_head_dir("tiny-llama", vocab_size=300)
    return [tiny_hf_dir("tiny-llama"), "--head", head], ["vocab_size is 300 in the head but 259 in the base"]


def case_head_with_two_layers(tmp_path, tiny_hf_dir, tiny_head_dir):
    head = tiny_head_dir("tiny-llama", num_layers=2)
    return [tiny_hf_dir("tiny-llama"), "--head", head], ["has 2 layers", "EAGLE heads have 1"]


def case_head_weights_disagree_with_config(tmp_path, tiny_hf_dir, tiny_head_dir):
    head = Path(shutil.copytree(tiny_head_dir("tiny-llama", intermediate_size=128), tmp_path / "head"))
    edit_config(head, intermediate_size=256)
    return [tiny_hf_dir("tiny-llama"), "--head", head], ["head in", "layers.0.mlp.gate_proj.weight",
                                                         "(128, 128)", "expected (256, 128)"]


def case_head_without_weights(tmp_path, tiny_hf_dir, tiny_head_dir):
    head = Path(shutil.copytree(tiny_head_dir("tiny-llama"), tmp_path / "head"))
    (head / "model.safetensors").unlink()
    return [tiny_hf_dir("tiny-llama"), "--head", head], ["no weights in", str(head)]


# --- options ---------------------------------------------------------------------------------------

def case_precision_int4(tmp_path, tiny_hf_dir):
    return ["tiny-llama", "--precision", "int4"], ["unsupported precision 'int4'", "fp32, fp16, int8"]


def case_target_tensorrt(tmp_path, tiny_hf_dir):
    return ["tiny-llama", "--target", "tensorrt"], ["unsupported target 'tensorrt'", "onnx"]


def case_max_length_too_small(tmp_path, tiny_hf_dir):
    return ["tiny-llama", "--max-length", "8"], ["--max-length 8 is too small"]


def case_max_length_negative(tmp_path, tiny_hf_dir):
    return ["tiny-llama", "--max-length", "-5"], ["--max-length -5 is too small"]


CASES = [case_unknown_alias, case_empty_directory, case_missing_weights, case_missing_shard,
         case_garbage_safetensors, case_truncated_safetensors, case_garbage_pytorch_bin, case_invalid_config_json,
         case_tensor_of_wrong_shape, case_missing_tensor, case_text_file, case_gguf_with_wrong_magic,
         case_gguf_with_garbage_after_magic, case_gpt2, case_mistral_sliding_window, case_yarn_rope_scaling,
         case_precision_int4, case_target_tensorrt, case_max_length_too_small, case_max_length_negative]
HEAD_CASES = [case_head_hidden_size_mismatch, case_head_vocab_mismatch, case_head_with_two_layers,
              case_head_weights_disagree_with_config, case_head_without_weights]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_bad_input(case, tmp_path, outs, tiny_hf_dir, export_cli):
    args, phrases = case(tmp_path, tiny_hf_dir)
    rc, stdout, err = export_cli(*args, "--out", outs / "artifact")
    assert rc == 1
    assert_one_error(rc, err, *phrases)
    assert "artifact:" not in stdout
    assert list(outs.iterdir()) == []


@pytest.mark.parametrize("case", HEAD_CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_bad_head(case, tmp_path, outs, tiny_hf_dir, tiny_head_dir, export_cli):
    args, phrases = case(tmp_path, tiny_hf_dir, tiny_head_dir)
    rc, _, err = export_cli(*args, "--out", outs / "artifact")
    assert_one_error(rc, err, *phrases)
    assert list(outs.iterdir()) == []


def test_head_and_no_head_exclude_each_other(export_cli, outs):
    with pytest.raises(SystemExit) as e:
        export_cli("tiny-llama", "--head", "x", "--no-head", "--out", outs / "artifact")
    assert e.value.code == 2
    assert list(outs.iterdir()) == []


# --- the output cannot be written ------------------------------------------------------------------

def test_output_under_a_regular_file(tmp_path, export_cli):
    blocker = tmp_path / "somefile"
    blocker.write_text("I am a file\n")
    rc, _, err = export_cli("tiny-llama", "--out", blocker / "sub" / "artifact")
    assert_one_error(rc, err, "cannot create", f"{blocker} is a file")
    assert blocker.read_text() == "I am a file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["somefile"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions (chmod 0o555 does not "
                                                "stop it writing); the regular-file variant covers this path")
def test_output_in_read_only_directory(tmp_path, export_cli):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc, _, err = export_cli("tiny-llama", "--out", ro / "artifact")
        assert_one_error(rc, err, "not writable", str(ro))
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_existing_output_without_force(outs, export_cli):
    existing = outs / "artifact"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine\n")
    rc, _, err = export_cli("tiny-llama", "--out", existing)
    assert_one_error(rc, err, "already exists", "--force")
    assert [p.name for p in outs.iterdir()] == ["artifact"]
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
    assert (existing / "keep.txt").read_text() == "mine\n"


def test_force_over_an_existing_file(outs, export_cli):
    target = outs / "artifact"
    target.write_text("a file, not an artifact\n")
    rc, _, err = export_cli("tiny-llama", "--out", target, "--force")
    assert_one_error(rc, err, str(target))
    assert [p.name for p in outs.iterdir()] == ["artifact"]


def test_force_refuses_a_directory_that_is_not_an_artifact(outs, export_cli):
    target = outs / "project"
    target.mkdir()
    (target / "precious.txt").write_text("not yours\n")
    rc, _, err = export_cli("tiny-llama", "--out", target, "--force")
    assert_one_error(rc, err, str(target))
    assert (target / "precious.txt").read_text() == "not yours\n"


# --- malformed configs and limits ----------------------------------------------------------------

def test_config_json_missing_fields(tmp_path, outs, tiny_hf_dir, export_cli):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 259}))
    rc, _, err = export_cli(d, "--out", outs / "artifact")
    assert_one_error(rc, err, "num_attention_heads")
    assert list(outs.iterdir()) == []


def test_config_json_not_an_object(tmp_path, outs, tiny_hf_dir, export_cli):
    d = copy_hf_dir(tiny_hf_dir, tmp_path)
    (d / "config.json").write_text("[1, 2]")
    rc, _, err = export_cli(d, "--out", outs / "artifact")
    assert_one_error(rc, err, "config.json")
    assert list(outs.iterdir()) == []


def test_max_length_zero_is_rejected(outs, export_cli):
    rc, _, err = export_cli("tiny-llama", "--max-length", "0", "--no-verify", "--out", outs / "artifact")
    assert_one_error(rc, err, "--max-length 0 is too small")
    assert list(outs.iterdir()) == []


def test_unknown_alias_writes_nothing_without_out(tmp_path, monkeypatch, export_cli):
    """Without --out the default is artifacts/<name> under the working directory."""
    monkeypatch.chdir(tmp_path)
    rc, _, err = export_cli("no-such-model")
    assert_one_error(rc, err, "unknown model 'no-such-model'")
    assert list(tmp_path.iterdir()) == []


def test_list_and_missing_model(export_cli, capsys):
    rc, stdout, _ = export_cli("--list")
    assert rc == 0 and "tiny-llama" in stdout and "smollm2-135m" in stdout
    with pytest.raises(SystemExit) as e:
        export_cli()
    assert e.value.code == 2
    assert "MODEL is required" in capsys.readouterr().err


def test_cli_exports_a_tiny_alias(outs, export_cli):
    """The positive control for the cases above: same options, good input."""
    rc, stdout, err = export_cli("tiny-qwen2", "--out", outs / "artifact", "--max-length", "64")
    assert rc == 0, err
    assert "error" not in err
    assert f"exported tiny-qwen2 ({default_precision()}, with draft head)" in stdout  # this CPU's default
    assert f"artifact: {(outs / 'artifact').resolve()}" in stdout
    assert [p.name for p in outs.iterdir()] == ["artifact"]
    assert load_checkpoint("tiny-qwen2").cfg.vocab_size == json.loads(
        (outs / "artifact" / "manifest.json").read_text())["model"]["config"]["vocab_size"]
