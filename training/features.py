"""The base's side of training: the frozen base, and its features for the head, extracted from
the conversations or generated with its own replies (self-distillation), computed into the cache."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models.llama import CausalLM, additive_bias, causal_bias
from models.train_data import Example

from .batches import length_batches, pooled_length_order
from .cache import items_digest, read_shards, save_shard
from .data import Selection
from .device import precision
from .log import log
from .unroll import new_cache

# Self-distillation prompts are sorted by length within pools of this many, whatever the batch.
# 96 (4 batches of 24) is the order the first cached replies were generated in; another value
# would reorder the prompts and invalidate every cached reply.
DISTILL_POOL = 96


def build_base(ckpt, n_positions: int, device) -> CausalLM:
    base = CausalLM(ckpt.cfg, n_positions)
    state = {k: v.float() for k, v in ckpt.state.items()}
    if ckpt.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    base.load_state_dict(state, strict=not ckpt.cfg.tie_word_embeddings)
    base.requires_grad_(False)
    return base.to(device).eval()


def base_hidden(base: CausalLM, ids, pos, bias, cache, start: int, taps: tuple[int, ...] = ()):
    """The head's training features without the (large) lm_head: the post-final-norm hidden states,
    preceded for an EAGLE-3 head by the inputs of the base layers `taps`, concatenated. The
    post-norm state is always last, so features[..., -H:] gives the base's next-token logits."""
    hidden, taken = base.hidden_states(ids, pos, bias, cache, start, taps)
    return torch.cat(taken + [hidden], dim=-1)


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
