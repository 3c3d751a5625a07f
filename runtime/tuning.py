"""What `python -m runtime tune` chose for a provider, recorded in the artifact (ARTIFACT/tuning.json):
the tree, and for generations decoded side by side, from how many on plain steps get more through."""
from __future__ import annotations

import json
from pathlib import Path

TUNING_FILE = "tuning.json"


def read_tuning(artifact: Path, provider: str) -> dict | None:
    """The tuned choices for `provider`, or None when the artifact was not tuned for it."""
    path = Path(artifact) / TUNING_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(provider)


def write_tuning(artifact: Path, provider: str, **entries) -> Path:
    """Record entries ("tree" choice fields, "batch") for `provider`, keeping the rest of the file."""
    path = Path(artifact) / TUNING_FILE
    tuning = json.loads(path.read_text()) if path.is_file() else {}
    tuning.setdefault(provider, {}).update(entries)
    path.write_text(json.dumps(tuning, indent=2) + "\n")
    return path


def plain_from(tuned: dict | None, tree: str) -> int | None:
    """How many generations side by side make plain steps faster than `tree` (its label), as
    measured for that tree; None when it was not measured, or trees stayed faster."""
    batch = (tuned or {}).get("batch")
    if not batch or batch["tree"] != tree:
        return None
    return batch["plain_from"]
