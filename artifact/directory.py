"""The artifact directory, created atomically: a failed or interrupted export leaves nothing."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .manifest import MANIFEST, ArtifactError


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
