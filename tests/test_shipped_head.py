"""The head shipped for the embedded default model: files match their recorded sha256 and load
against the SmolLM2-135M base configuration."""
import json

import numpy as np

from models.checksums import sha256
from models.config import ModelConfig
from models.registry import SHIPPED_HEADS
from models.weights import load_head

HEAD = SHIPPED_HEADS / "smollm2-135m"


def test_the_head_ships():
    assert {"config.json", "model.safetensors", "token_counts.npy", "SHA256SUMS"} <= \
        {p.name for p in HEAD.iterdir()}, f"{HEAD} lacks the shipped head's files"


def test_files_match_recorded_sha256():
    lines = (HEAD / "SHA256SUMS").read_text().split("\n")
    recorded = dict(reversed(line.split()) for line in lines if line.strip())
    assert {"config.json", "model.safetensors", "token_counts.npy"} <= set(recorded)
    for name, digest in recorded.items():
        assert sha256(HEAD / name) == digest, name


def test_token_counts_cover_the_vocabulary():
    """Reply-token frequencies for the reduced draft vocabulary (models/draft_vocab.py)."""
    counts = np.load(HEAD / "token_counts.npy", allow_pickle=False)
    assert counts.shape == (49152,) and counts.dtype == np.int64 and counts.min() >= 0
    assert counts.sum() > 10_000_000
    assert counts[2] > 0  # <|im_end|>, the end of every reply


def test_loads_with_the_smollm2_base(smollm2_artifact):
    base = ModelConfig.from_dict(json.loads((smollm2_artifact / "manifest.json").read_text())["model"]["config"])
    cfg, state = load_head(HEAD, base)
    assert cfg.num_layers == 1 and cfg.hidden_size == base.hidden_size
    assert "embed_tokens.weight" not in state
    assert all(t.dtype.is_floating_point for t in state.values())
