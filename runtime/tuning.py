"""The tree `python -m runtime tune` chose for a provider, recorded in the artifact (ARTIFACT/tuning.json)."""
from __future__ import annotations

import json
from pathlib import Path

TUNING_FILE = "tuning.json"


def read_tuning(artifact: Path, provider: str) -> dict | None:
    """The tuned choice for `provider`, or None when the artifact was not tuned for it."""
    path = Path(artifact) / TUNING_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(provider)
