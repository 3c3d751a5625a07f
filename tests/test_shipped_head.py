"""The heads shipped for the embedded default model (the alias's EAGLE-3 head and the earlier
EAGLE-1/2 one, HEAD): files match their recorded sha256 and load against the SmolLM2-135M base
configuration."""
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


def recorded_sha256(head) -> dict[str, str]:
    """{file: sha256} of a head's SHA256SUMS, each checked against the file."""
    lines = (head / "SHA256SUMS").read_text().split("\n")
    recorded = dict(reversed(line.split()) for line in lines if line.strip())
    for name, digest in recorded.items():
        assert sha256(head / name) == digest, name
    return recorded


def test_files_match_recorded_sha256():
    assert {"config.json", "model.safetensors", "token_counts.npy"} <= set(recorded_sha256(HEAD))


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


def test_the_eagle3_head_matches_its_checksums_and_loads(smollm2_artifact):
    """The alias's EAGLE-3 head (models/heads/smollm2-135m-eagle3)."""
    head = SHIPPED_HEADS / "smollm2-135m-eagle3"
    assert set(recorded_sha256(head)) == {"config.json", "model.safetensors", "token_counts.npy"}
    base = ModelConfig.from_dict(json.loads((smollm2_artifact / "manifest.json").read_text())["model"]["config"])
    cfg, state = load_head(head, base)
    assert cfg.eagle3 and cfg.num_layers == 1
    assert state["lm_head.weight"].shape == (8192, base.hidden_size)
