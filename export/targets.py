"""Export targets: one object per target (onnx, ipex, torch) that knows its precisions and default,
the options it takes, how it names its artifact and which exporter writes it. export/cli.py
chooses one and asks it; nothing else compares target names."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from models.draft_vocab import DraftVocab
from models.weights import Checkpoint

from .common import PORTABLE_PRECISION, ExportError, default_precision
from .onnx_export import export_onnx
from .onnx_graph import INT8_BLOCK, PRECISIONS
from .torch_export import PRECISIONS as TORCH_PRECISIONS, export_torch, import_ipex


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


@dataclass(frozen=True)
class Target:
    name: str
    precisions: tuple[str, ...]
    default: Callable[[], str]          # the precision when none is given
    onnx_options: bool                  # whether --attention and --int8-block apply
    run: Callable[..., dict]            # (target, ckpt, out, precision, options, log) -> manifest
    prepare: Callable[[], object] = lambda: None  # checks worth making before weights load (minutes)

    def precision(self, asked: str | None, log) -> str:
        """The precision to export: the one asked for, checked, or this target's default."""
        precision = asked or self.default()
        if not asked and self.onnx_options and precision != PORTABLE_PRECISION:
            log(f"precision {precision}: the default on this CPU (AMX int8 tiles); --precision int8 gives "
                "an artifact every x86-64 CPU runs")
        if precision not in self.precisions:
            raise ExportError(f"unsupported precision {precision!r} for --target {self.name}; "
                              f"choose one of {', '.join(self.precisions)}")
        return precision

    def check_options(self, options: Options) -> None:
        if not self.onnx_options and (options.attention or options.int8_block != INT8_BLOCK):
            raise ExportError(f"--attention and --int8-block apply to --target onnx only; a {self.name} "
                              "artifact's attention is exact")

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


def _export_onnx(target: Target, ckpt: Checkpoint, out: Path, precision: str, o: Options, log) -> dict:
    return export_onnx(ckpt, out, precision, o.max_length, verify=o.verify, overwrite=o.overwrite, log=log,
                       draft_precision=o.draft_precision, attention=o.attention, draft_vocab=o.draft_vocab,
                       int8_block=o.int8_block)


def _export_torch(target: Target, ckpt: Checkpoint, out: Path, precision: str, o: Options, log) -> dict:
    return export_torch(ckpt, out, target.name, precision, o.max_length, verify=o.verify, overwrite=o.overwrite,
                        log=log, draft_vocab=o.draft_vocab, draft_precision=o.draft_precision)


TARGETS = {t.name: t for t in (
    # onnx: the fastest precision whose speculation is lossless on the CPU exporting (default_precision).
    Target("onnx", PRECISIONS, default_precision, onnx_options=True, run=_export_onnx),
    Target("ipex", TORCH_PRECISIONS["ipex"], lambda: "bf16", onnx_options=False, run=_export_torch,
           prepare=import_ipex),
    Target("torch", TORCH_PRECISIONS["torch"], lambda: "fp32", onnx_options=False, run=_export_torch),
)}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ExportError(f"unsupported target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]
