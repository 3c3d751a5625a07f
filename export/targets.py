"""Export targets: one object per target (onnx, ipex, torch) that knows its precisions and default,
the options it takes, how it names its artifact and which exporter writes it. export/cli.py
chooses one and asks it; nothing else compares target names."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from models.cpu import CPU_KINDS, cpu_kind, int8_dot_products
from models.draft_vocab import DraftVocab
from models.weights import Checkpoint
from runtime import kernels

from .common import ExportError, cpu_entry, default_precision
from .quality import MIN_AGREEMENT
from .onnx_export import export_onnx
from .onnx_graph import BLOCK_PRECISIONS, INT8_BLOCK, INT8_BLOCKS, PRECISIONS
from .torch_export import IPEX_BF16_NEEDS, PRECISIONS as TORCH_PRECISIONS, export_torch, import_ipex, ipex_bf16_runs


@dataclass(frozen=True)
class Options:
    """What an export takes beyond the checkpoint and its precision."""
    max_length: int | None = None
    verify: bool = True
    overwrite: bool = False
    draft_precision: str | None = None
    draft_vocab: DraftVocab | None = None
    attention: str | None = None   # onnx only
    int8_block: int = INT8_BLOCK   # onnx only
    min_agreement: float = MIN_AGREEMENT  # the quality gate's threshold (export.quality)
    cpu_kind: str | None = None    # onnx only: the CPU kind whose path is the default (None: this CPU's)
    precision_from: str = "--precision"  # what chose the precision, recorded in the manifest


@dataclass(frozen=True)
class Target:
    name: str
    precisions: tuple[str, ...]
    default: Callable[[str | None], str]  # the precision when none is given, for a CPU kind (None: this CPU's)
    onnx_options: bool                  # whether --attention and --int8-block apply
    run: Callable[..., dict]            # (target, ckpt, out, precision, options, log) -> manifest
    missing: Callable[[str], str | None]  # precision -> what this CPU lacks to run it exactly, or None
    why_default: Callable[[str, str | None], str | None] = lambda precision, kind: None  # said when it is taken
    # (precision, options) -> the next safer layout, or None: where the default fails the quality gate
    safer: Callable[[str, Options], tuple[str, Options] | None] = lambda precision, options: None
    prepare: Callable[[], object] = lambda: None  # checks worth making before weights load (minutes)

    def precision(self, asked: str | None, log, kind: str | None = None) -> str:
        """The precision to export: the one asked for, checked, or this target's default for the CPU
        kind (this CPU's where None)."""
        precision = asked or self.default(kind)
        if not asked and (why := self.why_default(precision, kind)):
            log(f"precision {precision}: {why}")
        if precision not in self.precisions:
            raise ExportError(f"unsupported precision {precision!r} for --target {self.name}; "
                              f"choose one of {', '.join(self.precisions)}")
        return precision

    def check_cpu(self, precision: str, draft_precision: str | None, for_kind: str | None = None) -> None:
        """Refuse, before anything loads, a precision this CPU cannot run exactly: the export would
        otherwise take minutes and then fail its parity check, or give an artifact nothing here runs.
        `for_kind`: the --cpu-kind whose path chose the precision (the export checks it on this CPU)."""
        base = f"--cpu-kind {for_kind}'s path" if for_kind else "--precision"
        for flag, asked in ((base, precision), ("--draft-precision", draft_precision)):
            lacking = asked and self.missing(asked)
            if lacking:
                here = (f" (the export checks its graphs on the CPU exporting: export for --cpu-kind {for_kind} on "
                        "a CPU that runs its path)") if for_kind and flag == base else ""
                raise ExportError(f"{flag} {asked}: {lacking}{here}")

    def check_options(self, options: Options) -> None:
        if not self.onnx_options and (options.attention or options.int8_block != INT8_BLOCK):
            raise ExportError(f"--attention and --int8-block apply to --target onnx only; a {self.name} "
                              "artifact's attention is exact")
        if not self.onnx_options and options.cpu_kind:
            raise ExportError(f"--cpu-kind applies to --target onnx only; a {self.name} artifact's precision "
                              "follows what the CPU exporting it runs")
        if options.cpu_kind and options.cpu_kind not in CPU_KINDS:
            raise ExportError(f"unknown --cpu-kind {options.cpu_kind!r}; choose one of {', '.join(CPU_KINDS)}")

    def out(self, name: str, precision: str) -> Path:
        """The default artifact directory: the default precision's ONNX artifact keeps the plain name."""
        if not self.onnx_options:
            return Path("artifacts") / f"{name}-{self.name}-{precision}"
        return Path("artifacts") / (name if precision == default_precision() else f"{name}-{precision}")

    @property
    def provider(self) -> str:
        """The runtime provider that loads its artifacts (ONNX's: the CPU one, among others)."""
        return "cpu" if self.onnx_options else self.name

    def export(self, ckpt: Checkpoint, out: Path, precision: str, options: Options, log) -> dict:
        return self.run(self, ckpt, out, precision, options, log)

    def layout(self, precision: str, options: Options) -> str:
        block = self.onnx_options and precision in BLOCK_PRECISIONS and options.int8_block != INT8_BLOCK
        return f"--precision {precision}" + (f" --int8-block {options.int8_block}" if block else "")


def _export_onnx(target: Target, ckpt: Checkpoint, out: Path, precision: str, o: Options, log) -> dict:
    return export_onnx(ckpt, out, precision, o.max_length, verify=o.verify, overwrite=o.overwrite, log=log,
                       draft_precision=o.draft_precision, attention=o.attention, draft_vocab=o.draft_vocab,
                       int8_block=o.int8_block, min_agreement=o.min_agreement,
                       cpu=cpu_entry(o.cpu_kind or cpu_kind(), o.precision_from))


def _export_torch(target: Target, ckpt: Checkpoint, out: Path, precision: str, o: Options, log) -> dict:
    return export_torch(ckpt, out, target.name, precision, o.max_length, verify=o.verify, overwrite=o.overwrite,
                        log=log, draft_vocab=o.draft_vocab, draft_precision=o.draft_precision,
                        min_agreement=o.min_agreement)


def _onnx_missing(precision: str) -> str | None:
    if precision == "w8a8" and not int8_dot_products():
        return ("8-bit activations times 8-bit weights need AVX512-VNNI, AVX-VNNI or AMX (without them the "
                "integer kernels saturate), and this CPU has none of them; use --precision int8 (8-bit weights, "
                "every x86-64 CPU)")
    if precision == "w8a16":
        if cpu_kind() is None:
            return ("16-bit integer products run in this project's operator, written for x86-64 CPUs with AVX2, "
                    "which this CPU is not; use --precision int8")
        if why := kernels.missing():
            return why
    return None


def _onnx_safer(precision: str, options: Options) -> tuple[str, Options] | None:
    """w8a8, then int8 in blocks of 64, then of 32 (closer to the source weights), then fp32; w8a16
    (whose 16-bit activations round less than int8's) in blocks of 64, then of 32, then fp32."""
    if precision == "w8a8":
        return "int8", replace(options, int8_block=INT8_BLOCK)
    if precision in BLOCK_PRECISIONS and options.int8_block > min(INT8_BLOCKS):
        return precision, replace(options, int8_block=max(b for b in INT8_BLOCKS if b < options.int8_block))
    if precision in BLOCK_PRECISIONS:
        return "fp32", options
    return None


def _torch_safer(precision: str, options: Options) -> tuple[str, Options] | None:
    return None if precision == "fp32" else ("fp32", options)


def _onnx_why_default(precision: str, kind: str | None) -> str | None:
    named = kind or cpu_kind()
    where = f"--cpu-kind {kind} ({CPU_KINDS[kind]})" if kind else \
        (f"this CPU ({CPU_KINDS[named]})" if named else "this CPU (no x86-64 kind)")
    portable = "; --precision int8 gives an artifact every x86-64 CPU runs" if precision == "w8a8" else ""
    return f"the fastest lossless path for {where}{portable}"


def _ipex_why_default(precision: str, kind: str | None) -> str | None:
    if precision != "bf16":
        return "the default on this CPU, which lacks what IPEX's bf16 needs (AVX512-BF16 or AMX)"
    return None


def _ipex_missing(precision: str) -> str | None:
    if precision == "bf16" and not ipex_bf16_runs():
        return f"{IPEX_BF16_NEEDS}; use --precision fp32 or int8 (weight-only), or an ONNX artifact"
    return None


TARGETS = {t.name: t for t in (
    # onnx: the fastest precision whose speculation is lossless on a CPU kind (default_precision).
    Target("onnx", PRECISIONS, default_precision, onnx_options=True, run=_export_onnx, missing=_onnx_missing,
           why_default=_onnx_why_default, safer=_onnx_safer),
    Target("ipex", TORCH_PRECISIONS["ipex"], lambda kind: "bf16" if ipex_bf16_runs() else "fp32", onnx_options=False,
           run=_export_torch, missing=_ipex_missing, why_default=_ipex_why_default, safer=_torch_safer,
           prepare=import_ipex),
    Target("torch", TORCH_PRECISIONS["torch"], lambda kind: "fp32", onnx_options=False, run=_export_torch,
           missing=lambda precision: None, safer=_torch_safer),
)}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ExportError(f"unsupported target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]
