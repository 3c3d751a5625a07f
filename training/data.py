"""What a run takes from its conversations: the dev split, the training examples, the
self-distillation prompts and the --replies examples."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.train_data import Example, encode, prompt_ids, read_conversations, split, write_dev_prompts

from .log import log
from .replies import read_replies


@dataclass
class Selection:
    """The examples and prompts a run takes from its conversations."""
    train: list[Example]
    dev: list[Example]
    distill_prompts: list[tuple[str, np.ndarray]]   # (conversation id, first-turn prompt ids)
    dev_prompts: list[tuple[str, np.ndarray]]
    replies: list[Example]                          # --replies: prompt + self-distilled reply, reply masked in


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
