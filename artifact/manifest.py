"""manifest.json: its format, the keys every reader may rely on, checksums, reading and writing."""
from __future__ import annotations

import json
from pathlib import Path

from models.checksums import sha256

FORMAT = "eagle2-onnx"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# The keys the runtime reads without a default; an artifact without one of them is refused at load.
# Optional keys (read with a default): attention, draft_precision, exact_key_block, int8_block,
# verify_exact, verify_min_rows, parity, versions.
REQUIRED = {
    "target": "onnx, ipex or torch",
    "precision": "the base graph's weights",
    "max_length": "the longest sequence the caches and rotary tables were exported for",
    "io_dtype": "float32 or float16: the graphs' hidden states and logits",
    "model": "source and config (a Hugging Face config as a dict)",
    "head": "the draft head's source, kind and config, or null",
    "graphs": "base (and draft) graph: file, inputs and outputs with names, shapes and dtypes",
    "tokenizer": "the tokenizer directory, relative to the artifact",
    "stop_token_ids": "the ids that end a reply",
    "tree_defaults": "total_tokens, depth and top_k of the draft tree",
}


class ArtifactError(ValueError):
    """A missing, broken or incompatible artifact directory."""


def checksums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def write_manifest(root: Path, manifest: dict) -> None:
    """Write `manifest` with the format fields and the checksums of every file already in `root`."""
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise ArtifactError(f"manifest lacks {', '.join(missing)}")  # an exporter's bug, caught before writing
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": checksums(root)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(root: Path, verify_checksums: bool = True) -> dict:
    """Load and check an artifact's manifest: format, version, required keys, presence and sha256 of
    every file."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{root} is not an artifact directory (no {MANIFEST}); create one with python -m export")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is corrupt: {e}") from None
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {manifest.get('format_version')} is not supported "
                            f"(this runtime reads version {FORMAT_VERSION}); re-export the model")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise ArtifactError(f"{path} lacks {', '.join(missing)}; re-export the model")
    for name, digest in manifest.get("files", {}).items():
        f = root / name
        if not f.is_file():
            raise ArtifactError(f"artifact {root} is missing {name}")
        if verify_checksums and sha256(f) != digest:
            raise ArtifactError(f"artifact {root}: checksum mismatch for {name} (file changed or corrupt)")
    return manifest
