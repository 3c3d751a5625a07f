"""Whether an ONNX artifact's CPU path suits the CPU loading it. The export records the CPU kind it
chose the path for (the manifest's "cpu" entry); at load an artifact whose products cannot run
exactly here is refused, and one made for another kind's path, where this kind's is faster, is
loaded with advice naming the export that gives this CPU's path."""
from __future__ import annotations

from models.cpu import CPU_KINDS, FROM_KIND_PATH, cpu_kind, int8_dot_products, onnx_cpu_path


def _reexport(manifest: dict, kind: str | None) -> str:
    source = manifest["model"]["source"].split(" (")[0]
    if kind is None:
        return f"`python -m export {source} --precision int8`"
    return f"`python -m export {source} --cpu-kind {kind}` (or the export run on this CPU)"


def _this_cpu(kind: str | None) -> str:
    return f"this CPU ({CPU_KINDS[kind]})" if kind else "this CPU"


def refusal(manifest: dict) -> str | None:
    """Why the artifact cannot run exactly on this CPU, and the export that can; None where it can.

    Without VNNI, MLAS multiplies uint8 by int8 with vpmaddubsw, whose 16-bit pair sums saturate on
    w8a8's full-range operands: the products would be wrong, not merely rounded."""
    if "w8a8" in (manifest.get("precision"), manifest.get("draft_precision")) and not int8_dot_products():
        kind = cpu_kind()
        return (f"w8a8 artifacts need a CPU with 8-bit dot products (AVX512-VNNI, AVX-VNNI or AMX), which "
                f"{_this_cpu(kind)} lacks: re-export it as int8 with {_reexport(manifest, kind)}")
    if "w8a16" in (manifest.get("precision"), manifest.get("draft_precision")) and cpu_kind() is None:
        return ("w8a16 artifacts run this project's 16-bit integer products, written for x86-64 CPUs with AVX2, "
                f"which this CPU is not: re-export it with {_reexport(manifest, None)}")
    return None


def advice(manifest: dict) -> str | None:
    """Where the artifact took another CPU kind's path and this CPU's is another precision: what to
    re-export (its steps still run exactly here, only slower than this CPU's path). None otherwise,
    also where the precision was asked for or chosen by the quality gate."""
    made_for = manifest.get("cpu") or {}
    here = cpu_kind()
    if made_for.get("precision_from") != FROM_KIND_PATH or here is None or made_for.get("kind") == here:
        return None
    best = onnx_cpu_path(here)
    if best == manifest.get("precision"):
        return None
    made = made_for.get("kind")
    return (f"this artifact takes {CPU_KINDS.get(made, made)}'s path ({manifest['precision']}, exported on "
            f"{made_for.get('exported_on')}); the fastest lossless path on {_this_cpu(here)} is {best}: "
            f"re-export it with {_reexport(manifest, here)}")
