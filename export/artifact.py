"""The artifact directory: atomic creation, manifest, checksums.

Layout:
    base.onnx, draft.onnx   graphs (draft only when a head was exported)
    weights.bin             every weight of both graphs, once (ONNX external data)
    tokenizer/              tokenizer.json, tokenizer_config.json, chat_template.jinja
    manifest.json           what the runtime needs to check and drive the graphs
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from models.checksums import sha256

FORMAT = "eagle2-onnx"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ArtifactError(ValueError):
    """A missing, broken or incompatible artifact directory."""


def checksums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def check_output(final: Path, overwrite: bool = False) -> Path:
    """Refuse an output that cannot or must not be written, before any work is done.

    --force replaces only a previous artifact (or an empty directory), never other data.
    """
    final = Path(final).resolve()
    if final.exists():
        if not final.is_dir():
            raise ArtifactError(f"{final} exists and is not a directory")
        if not overwrite:
            raise ArtifactError(f"{final} already exists (pass --force to replace it)")
        if any(final.iterdir()) and not (final / MANIFEST).is_file():
            raise ArtifactError(f"{final} is not an artifact directory; refusing to replace it with --force")
    ancestor = final.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ArtifactError(f"cannot create {final}: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK):
        raise ArtifactError(f"cannot create {final}: {ancestor} is not writable")
    return final


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False):
    """Yield a temporary sibling of `final`; rename it into place only if the block succeeds.

    A failed or interrupted export (any exception, KeyboardInterrupt included) leaves nothing.
    """
    final = check_output(final, overwrite)
    parent = final.parent
    created = [d for d in (parent, *parent.parents) if not d.exists()]
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(f"cannot create output directory {parent}: {e.strerror}") from None
    tmp = parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            old = parent / f".{final.name}.old-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:  # innermost first: leave no empty directories behind either
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def write_manifest(root: Path, manifest: dict) -> None:
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": checksums(root)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(root: Path, verify_checksums: bool = True) -> dict:
    """Load and check an artifact's manifest: format, version, presence and sha256 of every file."""
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
    for name, digest in manifest.get("files", {}).items():
        f = root / name
        if not f.is_file():
            raise ArtifactError(f"artifact {root} is missing {name}")
        if verify_checksums and sha256(f) != digest:
            raise ArtifactError(f"artifact {root}: checksum mismatch for {name} (file changed or corrupt)")
    return manifest
