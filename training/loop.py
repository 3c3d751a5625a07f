"""The training loop: the plan of steps, AdamW with warmup and cosine decay, checkpoints and
--resume, evaluation at each epoch's end."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .batches import Batch, epoch_batches
from .device import precision
from .evaluate import describe, evaluate
from .log import log
from .losses import head_losses


def lr_at(progress: float, warmup: float, peak: float, floor: float = 0.1) -> float:
    """Linear warmup over the first `warmup` share of training, then cosine decay to floor*peak.
    `progress` in [0, 1] is the larger of the step share and (with --time-budget) the time share."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.01)
    x = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x)))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step-*.pt"))
    return found[-1] if found else None


def save_checkpoint(ckpt_dir: Path, head, opt, step: int, fingerprint: str, history: list,
                    time_progress: float, keep: int = 2):
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{step:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optim": opt.state_dict(), "step": step,
                "fingerprint": fingerprint, "history": history, "time_progress": time_progress}, tmp)
    os.replace(tmp, path)
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-keep]:
        old.unlink()


def plan_steps(args, train: dict) -> list[tuple[int, list[int]]]:
    """(epoch, batch) of every step; a fractional last epoch takes its share of the batches."""
    plan = []
    for ep in range(max(1, math.ceil(args.epochs))):
        bs = epoch_batches(train["lengths"], args.batch_tokens, args.seed * 1000 + ep)
        if ep + 1 > args.epochs:
            bs = bs[:max(1, int(len(bs) * (args.epochs - ep)))]
        plan += [(ep, b) for b in bs]
    return plan


def resume(args, head, opt, ckpt_dir: Path, fingerprint: str, total: int) -> tuple[int, list, float]:
    """(step, history, time progress) to start from: the latest checkpoint's with --resume, else a
    fresh start (older checkpoints deleted)."""
    if args.resume:
        last = latest_checkpoint(ckpt_dir)
        if last is None:
            log("--resume: no checkpoint yet, starting from scratch")
            return 0, [], 0.0
        state = torch.load(last, map_location=next(head.parameters()).device, weights_only=True)
        if state["fingerprint"] != fingerprint:
            raise SystemExit(f"--resume: {last} was trained on other data; use another --out")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optim"])
        log(f"resumed from {last.name} (step {state['step']} of {total})")
        return state["step"], state["history"], float(state.get("time_progress", 0.0))
    if latest_checkpoint(ckpt_dir) is not None:
        log("starting over (pass --resume to continue from the checkpoints in --out)")
        for old in ckpt_dir.glob("step-*.pt"):
            old.unlink()
    return 0, [], 0.0


@dataclass
class Run:
    """What the training loop did."""
    step: int
    total: int
    history: list
    tokens: int
    seconds: float


def new_optimizer(args, head) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.95) with weight decay on the weight matrices only."""
    decay = [p for n, p in head.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in head.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))


def progress_clock(args, budget_end: float | None, total: int, p_time0: float):
    """(progress, start time): progress(step) is (the share of training done, the share of the time
    budget spent), the first being the larger of the step share and the time share, so that the
    schedule ends at the planned steps or at the deadline, whichever comes first."""
    t_train = time.time()
    train_budget = None
    if budget_end is not None:
        train_budget = max(60.0, budget_end - t_train - (60 + 0.02 * 60 * args.time_budget))  # final eval and save
        log(f"time budget: {train_budget / 60:.1f} min for training; the schedule ends at the planned "
            f"{total} steps or at the deadline, whichever comes first")

    def progress(at_step: int) -> tuple[float, float]:
        p_time = p_time0
        if train_budget is not None:
            p_time = p_time0 + (1 - p_time0) * (time.time() - t_train) / train_budget
        return max(at_step / total, p_time), p_time
    return progress, t_train


def snapshot_keeper(args, plan: list, train: dict, snapshot, progress, step: int):
    """keep(step, progress): calls `snapshot` at step 0 and whenever progress passes another
    1/--snapshots of the way from where training starts (`step`); without `snapshot`, nothing."""
    total = len(plan)
    if snapshot is not None:
        planned_tokens = np.cumsum([0] + [sum(int(train["lengths"][i]) for i in items) for _, items in plan])
    snapped = int(progress(step)[0] * args.snapshots) if snapshot is not None else 0

    def keep(at_step: int, prog: float) -> None:
        nonlocal snapped
        if snapshot is not None and (at_step == 0 or int(prog * args.snapshots) > snapped):
            snapped = int(prog * args.snapshots)
            snapshot(at_step, int(planned_tokens[at_step]), round(at_step * args.epochs / total, 3))
    return keep


def train_step(args, head, opt, emb, lm, train: dict, items: list[int], device, gen, step: int, lr: float) -> dict:
    """One optimizer step at learning rate `lr` on the sequences `items`; returns head_losses' result."""
    for g in opt.param_groups:
        g["lr"] = lr
    gen.manual_seed(args.seed * 1_000_003 + step)
    with precision(device, args.bf16):
        r = head_losses(head, emb, lm, Batch(train, items, device), args.noise, gen, args.ce_fraction,
                        args.unroll)
    opt.zero_grad(set_to_none=True)
    r["loss"].backward()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
    opt.step()
    return r


def log_window(window: dict, step: int, total: int, ep: int, lr: float, tok_per_s: float, bar) -> dict:
    """The record of the steps since the last one (their means of `window`'s sums), shown and logged."""
    n = max(window["n"], 1)
    rec = {"step": step, "epoch": ep + 1, "lr": lr,
           **{k: window[k] / n for k in ("loss", "vloss", "ploss", "acc")},
           "tok_per_s": tok_per_s}
    bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['acc']:.3f}", refresh=False)
    log(f"step {step}/{total} ep {ep + 1} loss {rec['loss']:.4f} (v {rec['vloss']:.4f} p {rec['ploss']:.3f}) "
        f"acc {rec['acc']:.3f} lr {lr:.2e} {rec['tok_per_s']:.0f} tok/s")
    return rec


def train_loop(args, head, emb, lm, train: dict, watch: dict | None, watch_name: str, fingerprint: str,
               ckpt_dir: Path, device, budget_end: float | None, depth: int, snapshot=None) -> Run:
    """Train along the plan (until the time budget's end, if sooner), evaluating on `watch` at each
    epoch's end, logging and checkpointing as asked; `snapshot(step, tokens trained on, epochs)`
    keeps the head at the start and at each 1/--snapshots of the way."""
    opt = new_optimizer(args, head)
    plan = plan_steps(args, train)
    total = len(plan)
    step, history, p_time0 = resume(args, head, opt, ckpt_dir, fingerprint, total)
    progress, t_train = progress_clock(args, budget_end, total, p_time0)
    log(f"training: {len(train['lengths'])} sequences, {int(train['offsets'][-1])} tokens, up to {total} steps "
        f"({args.epochs} epochs), lr {args.lr}, warmup {args.warmup:.0%}")
    keep = snapshot_keeper(args, plan, train, snapshot, progress, step)
    if step == 0:
        keep(0, 0.0)
        ev = evaluate(head, emb, lm, watch, args.batch_tokens, device, depth)
        if ev:
            log(f"{watch_name} before training: {describe(ev, depth)}")
    gen = torch.Generator(device=device)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", mininterval=10, dynamic_ncols=True)
    window = {"loss": 0.0, "vloss": 0.0, "ploss": 0.0, "acc": 0.0, "n": 0}
    tokens_done, epoch = 0, plan[min(step, total - 1)][0]
    while step < total:
        prog, _ = progress(step)
        if prog >= 1.0:
            log(f"time budget reached at step {step} of {total}")
            break
        ep, items = plan[step]
        if ep != epoch:
            ev = evaluate(head, emb, lm, watch, args.batch_tokens, device, depth)
            if ev:
                log(f"epoch {epoch + 1} done: {watch_name} {describe(ev, depth)}")
                history.append({"step": step, "epoch": epoch + 1, "dev": ev, "dev_split": watch_name})
            epoch = ep
        lr = lr_at(max(prog, (step + 1) / total), args.warmup, args.lr)
        r = train_step(args, head, opt, emb, lm, train, items, device, gen, step, lr)
        step += 1
        tokens_done += sum(int(train["lengths"][i]) for i in items)
        for k in ("loss", "vloss", "ploss"):
            window[k] += float(r[k].detach()) * r["n"]
        window["acc"] += r["acc"] * r["n"]
        window["n"] += r["n"]
        bar.update(1)
        if step % args.log_every == 0 or step == total:
            tok_per_s = tokens_done / max(time.time() - t_train, 1e-9)
            history.append(log_window(window, step, total, ep, lr, tok_per_s, bar))
            window = {"loss": 0.0, "vloss": 0.0, "ploss": 0.0, "acc": 0.0, "n": 0}
        if step % args.save_every == 0 or step == total:
            save_checkpoint(ckpt_dir, head, opt, step, fingerprint, history, progress(step)[1])
        keep(step, 1.0 if step == total else progress(step)[0])
    bar.close()
    if step % args.save_every != 0 and step != total:
        save_checkpoint(ckpt_dir, head, opt, step, fingerprint, history, 1.0)
    keep(step, 1.0)  # where a time budget stopped training short of the plan
    return Run(step, total, history, tokens_done, time.time() - t_train)
