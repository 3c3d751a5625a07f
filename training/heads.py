"""The head a run trains, fresh or from --init, and its saving in the official EAGLE-1/2 format
(an EAGLE-3 head's is training.train_eagle3's), also at points along the way (--snapshots)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from models.config import ModelConfig
from models.draft_vocab import COUNTS_FILE
from models.llama import Eagle3Head, EagleHead
from models.weights import load_head

from .log import log
from .train_eagle3 import new_eagle3_head, reply_counts


def head_config(cfg: ModelConfig) -> ModelConfig:
    d = cfg.to_dict()
    d.update(num_layers=1, fc_bias=True)
    return ModelConfig.from_dict(d)


def draft_counts(args, train: dict, vocab_size: int) -> np.ndarray | None:
    """The reply-token counts an EAGLE-3 head's draft vocabulary comes from: this data's for a new
    head; a head continued with --init keeps its vocabulary, so the counts it shipped with (None if
    it shipped none)."""
    if args.init is None:
        return reply_counts(train, vocab_size)
    path = Path(args.init) / COUNTS_FILE
    return np.load(path, allow_pickle=False) if path.exists() else None


def new_head(args, ckpt, counts: np.ndarray | None, taps: tuple[int, ...], n_positions: int, device):
    """The head to train: from --init, else a fresh EAGLE-3 head over `taps` or a fresh EAGLE-1/2 one."""
    cfg = ckpt.cfg
    if args.init is not None:
        hcfg, init_state = load_head(args.init, cfg)
        if hcfg.eagle3 != bool(taps):
            raise SystemExit(f"--init {args.init} is an {'EAGLE-3' if hcfg.eagle3 else 'EAGLE-1/2'} head; "
                             f"--arch is {args.arch}")
        head = (Eagle3Head if hcfg.eagle3 else EagleHead)(hcfg, n_positions)
        head.load_state_dict({k: v if k == "d2t" else v.float() for k, v in init_state.items()})
        head = head.to(device)
        log(f"initialised from the head in {args.init}")
    elif taps:
        head = new_eagle3_head(cfg, ckpt.state, counts, args.draft_vocab, n_positions).to(device)
        log(f"EAGLE-3 head over base layers {taps}, draft vocabulary {head.cfg.draft_vocab_size} tokens "
            f"({counts[head.vocab.cpu().numpy()].sum() / max(counts.sum(), 1):.1%} of the training replies' tokens)")
    else:
        head = EagleHead(head_config(cfg), n_positions).to(device)
    head.train()
    return head


def save_head(out: Path, head: EagleHead) -> None:
    from safetensors.torch import save_file
    cfg = head.cfg.to_hf()
    cfg.update(num_hidden_layers=1, bias=True, qkv_bias=head.cfg.qkv_bias, torch_dtype="float16")
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in head.state_dict().items()}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def snapshot_saver(args, out: Path, head, save):
    """With --snapshots, snapshot(step, tokens trained on, epochs) keeps `head` as it is then, with
    `save`, in DIR/snapshots/step-N/; else None. A run that does not --resume starts the folder over."""
    snapshots = out / "snapshots"
    if not args.resume and snapshots.exists():
        shutil.rmtree(snapshots)

    def snapshot(step: int, tokens: int, epochs: float) -> None:
        d = snapshots / f"step-{step:07d}"
        d.mkdir(parents=True, exist_ok=True)
        save(d, head)
        (d / "snapshot.json").write_text(json.dumps({"step": step, "trained_tokens": tokens, "epochs": epochs,
                                                     "init": str(args.init) if args.init else None}) + "\n")
    return snapshot if args.snapshots else None
