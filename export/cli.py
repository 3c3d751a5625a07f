"""python -m export MODEL [--head HEAD | --no-head] [--out DIR] [--target onnx] [--precision P] ..."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from artifact.directory import check_output
from artifact.manifest import ArtifactError
from models.config import UnsupportedModelError
from models.cpu import CPU_KINDS, FROM_KIND_PATH
from models.gguf_blocks import GGUFBlocksError
from models.registry import ALIASES
from models.train_data import DataError
from models.weights import WeightsError

from .common import DEFAULT_DRAFT_VOCAB, ExportError, choose_draft_vocab
from .onnx_graph import ATTENTIONS, INT8_BLOCK, INT8_BLOCKS
from .quality import MIN_AGREEMENT, QualityError
from .targets import Options, target
from .verify import ParityError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export", description="Export a model and its EAGLE draft head.")
    p.add_argument("model", nargs="?", help="alias (see --list), HF model directory, .gguf file or hub id")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--head", help="EAGLE-1/2 or EAGLE-3 head directory or hub id (default: the alias's head)")
    g.add_argument("--no-head", action="store_true", help="export the base graph alone")
    p.add_argument("--out", type=Path, help="artifact directory (default: artifacts/<name>, "
                   "artifacts/<name>-<precision> for other than the default precision)")
    p.add_argument("--target", default="onnx", help="onnx (ONNX Runtime; default), ipex (intel-extension-for-pytorch, "
                   "in .venv-ipex) or torch (plain PyTorch, CPU or CUDA)")
    p.add_argument("--precision", help="onnx: int8 (8-bit weights, MatMulNBits; every CPU, the default off "
                   "x86-64), w8a16 (8-bit weights times 16-bit activation rows, this project's exact integer "
                   "operator: cheap trees; the default on x86-64 CPUs without AMX), "
                   "w8a8 (8-bit weights and activation rows, SmoothQuant; integer GEMMs: cheap trees on AMX, "
                   "needs VNNI or AMX; the default on CPUs with AMX), fp32, fp16 (CUDA), "
                   "gguf (a GGUF's own quantized weights as they are: Q4_0, Q4_1, Q8_0); "
                   "ipex: bf16 (default), fp32, int8 (weight-only); torch: fp32 (default), bf16, fp16")
    p.add_argument("--cpu-kind", choices=CPU_KINDS, help="onnx: the CPU kind the artifact is for; its fastest "
                   "lossless path is the default precision (w8a8 for amx, w8a16 for the others) and the runtime "
                   "checks it at load (default: this CPU's kind; " + ", ".join(f"{k}: {v}" for k, v in CPU_KINDS.items())
                   + ")")
    p.add_argument("--draft-precision", help="precision of the draft graph (onnx default: int8 for fp32/int8 "
                   "bases, fp16 for fp16; ipex: int8; torch: the base's)")
    p.add_argument("--attention", choices=ATTENTIONS, help="kernel (default on x86-64 CPUs, but for fp16): this "
                   "project's CPU operator over 16-bit caches, reading only the positions each row attends to, every "
                   "verified tree node computed bitwise as plain decoding computes it (built by ci/install.sh: "
                   "`bash ci/build_kernels.sh`); exact (the default elsewhere and for fp16): the same guarantee "
                   "from plain operators, over fp32 caches, and the graph ONNX Runtime's CUDA provider runs; "
                   "fused: GroupQueryAttention (OpenVINO)")
    p.add_argument("--int8-block", type=int, choices=INT8_BLOCKS, default=INT8_BLOCK,
                   help=f"block size of int8 and w8a16 weights (onnx; default {INT8_BLOCK}): 32 rounds "
                   "closer to the source weights and decodes slower (README, 'Precisions')")
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, metavar="N",
                   help="the draft ranks only the N most frequent reply tokens (verification keeps the whole "
                   f"vocabulary; 0 = all tokens; default {DEFAULT_DRAFT_VOCAB})")
    p.add_argument("--max-length", type=int, help="longest sequence (default: the model's context, capped where one "
                                                  "sequence's fp32 K/V would take over 1/4 of this machine's memory)")
    p.add_argument("--min-agreement", type=float, default=MIN_AGREEMENT, metavar="A",
                   help="quality gate: the least top-1 agreement with the fp32 checkpoint, teacher-forced on the "
                   f"calibration chats (default {MIN_AGREEMENT}; 0 = record it only). Below it an asked-for "
                   "precision is refused and the default falls back to a safer layout")
    p.add_argument("--no-verify", action="store_true", help="skip the parity check against PyTorch and the quality gate")
    p.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    p.add_argument("--list", action="store_true", help="print the aliases and exit")
    return p


def default_out(model: str, precision: str, target_name: str = "onnx") -> Path:
    name = model if model in ALIASES else Path(model.rstrip("/")).name.removesuffix(".gguf").replace("/", "--")
    return target(target_name).out(name, precision)


def export_gated(chosen, ckpt, out: Path, precision: str, options: Options, fall_back: bool, log) -> tuple[str, dict]:
    """Export; where the quality gate refuses the layout, fall back to the next safer one if the
    precision was the default (`fall_back`), else refuse naming it."""
    while True:
        try:
            return precision, chosen.export(ckpt, out, precision, options, log)
        except QualityError as e:
            safer = chosen.safer(precision, options)
            if safer is None:
                raise
            if not fall_back:
                raise QualityError(f"{e}; export {chosen.layout(*safer)}, or keep this one with --min-agreement "
                                   f"{int(e.agreement * 100) / 100}", e.agreement) from None
            log(f"{e}: falling back to {chosen.layout(*safer)}")
            precision, options = safer[0], dataclasses.replace(safer[1], precision_from="the quality gate")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.list:
        for name, a in ALIASES.items():
            print(f"{name:14} {a.note}\n{'':14} base: {a.base}\n{'':14} head: {a.head}")
        return 0
    if not args.model:
        parser().error("MODEL is required (or --list)")
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    try:
        chosen = target(args.target)
        options = Options(args.max_length, verify=not args.no_verify, overwrite=args.force,
                          draft_precision=args.draft_precision, attention=args.attention, int8_block=args.int8_block,
                          min_agreement=args.min_agreement, cpu_kind=args.cpu_kind,
                          precision_from="--precision" if args.precision else FROM_KIND_PATH)
        chosen.check_options(options)
        precision = chosen.precision(args.precision, log, args.cpu_kind)
        chosen.check_cpu(precision, args.draft_precision, args.cpu_kind if not args.precision else None)
        chosen.prepare()
        out = args.out or default_out(args.model, precision, chosen.name)
        check_output(out, args.force)
        from models.registry import load_checkpoint
        print(f"loading {args.model} ...", file=sys.stderr)
        ckpt = load_checkpoint(args.model, head=args.head, no_head=args.no_head)
        options = dataclasses.replace(options, draft_vocab=choose_draft_vocab(ckpt, args.draft_vocab))
        precision, manifest = export_gated(chosen, ckpt, out, precision, options, args.precision is None, log)
    except (WeightsError, UnsupportedModelError, ArtifactError, ExportError, ParityError, DataError,
            GGUFBlocksError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    head = "with draft head" if manifest["head"] else "base only (no draft head)"
    kind = precision if chosen.name == "onnx" else f"{chosen.name}, {precision}"
    print(f"exported {args.model} ({kind}, {head}) in {manifest['export_seconds']} s")
    print(f"artifact: {out.resolve()}")
    provider = "" if chosen.provider == "cpu" else f" --provider {chosen.provider}"
    print(f'next: python -m runtime generate {out}{provider} --prompt "What is the capital of France?" --stats')
    return 0
