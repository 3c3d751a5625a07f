"""Self-distilled replies made by the ONNX Runtime engine, many generations side by side, into a
compact file that is committed with the project, so that a new machine trains on them without
regenerating them (python -m training.train_head --replies FILE).

    python -m training.distill ARTIFACT --out FILE.npz [--data sharegpt] [--skip 0] [--n 3000]
        [--max-new-tokens 128] [--parallel 16] [--min-prompt 0] [--max-prompt 256] [--after FIRST.npz]
    python -m training.distill ARTIFACT --against-torch BASE [--n 32] ...   # speed against the trainer's loop

Prompts: the first user turn (with any system turn) of the training split's conversations, in the
trainer's order (models.train_data.split: the dev split stays held out), from the --skip-th on,
skipping those longer than --max-prompt tokens or no longer than --min-prompt. With --after
FIRST.npz, the second user turn of that file's conversations instead, after the first turn and the
base's own (complete) reply. Replies: greedy, through the artifact's EAGLE-2 tree, which is
lossless: each reply is the one plain decoding of the artifact gives, end-of-turn token included.
Use an fp32 artifact of the base the head is for (python -m export BASE --precision fp32): its
replies are the base's own, up to rounding.

The file (numpy .npz, compressed): prompt and reply token ids, concatenated (uint16 where the
vocabulary fits), their lengths, the conversation ids, and a manifest (JSON, also written beside
it as FILE.json) of how they were made. It is rewritten every --chunk replies, so an interrupted
run continues where it stopped when started again with the same settings.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .replies import FORMAT, read, write

SETTINGS = ("data", "skip", "max_new_tokens", "min_prompt", "max_prompt", "artifact_sha256", "after")
# Settings added after files were made: the value those files were made with.
SETTING_DEFAULTS = {"min_prompt": 0}


def prompts(gen, data: str, skip: int, n: int, max_prompt: int, dev_percent: float, seed: int,
            after: dict | None = None, min_prompt: int = 0):
    """(conversation id, prompt ids) of up to n training conversations from the skip-th on whose
    prompts are longer than min_prompt tokens and no longer than max_prompt.

    `after` (a first-turn replies file, as read()): instead, the second user turn of its
    conversations, from its skip-th reply on, following the first turn and the base's own reply to
    it, as a chat with the model goes on."""
    from models.train_data import first_turn, read_conversations, split
    train, _ = split(read_conversations(data), dev_percent, seed)
    out = []
    if after is None:
        for conv in train[skip:]:
            if len(out) >= n:
                break
            ids = gen.tokenizer.apply_chat_template(first_turn(conv))
            if min_prompt < len(ids) <= max_prompt:
                out.append((conv.id, ids))
        return out
    convs = {c.id: c for c in train}
    stops = set(gen.manifest["stop_token_ids"])
    for cid, reply in zip(after["conversation_ids"][skip:], after["replies"][skip:]):
        if len(out) >= n:
            break
        conv = convs.get(cid)
        users = [k for k, m in enumerate(conv.messages) if m["role"] == "user"] if conv else []
        if len(users) < 2 or not reply or reply[-1] not in stops:
            continue  # no second turn, or a first reply cut at the token limit: not how chats go on
        answer = {"role": "assistant", "content": gen.tokenizer.decode(reply).strip()}
        ids = gen.tokenizer.apply_chat_template(first_turn(conv) + [answer, conv.messages[users[1]]])
        if min_prompt < len(ids) <= max_prompt:
            out.append((cid, ids))
    return out


def against_torch(gen, base_name: str, todo: list, max_new: int, batch: int) -> dict:
    """The same prompts through the trainer's own batched torch loop (--self-distill's,
    generate_batch, `batch` at a time) and through the engine: tokens/s of each, and how many
    replies agree (both greedy on the same weights; fp32 rounding may break a near-tie otherwise)."""
    import torch

    from models.registry import load_checkpoint
    from training.features import build_base, generate_batch
    ckpt = load_checkpoint(base_name, no_head=True)
    base = build_base(ckpt, max(len(q) for _, q in todo) + max_new + 8, torch.device("cpu"))
    t0 = time.perf_counter()
    loop = []
    for start in range(0, len(todo), batch):
        prompts = [np.asarray(q, np.int32) for _, q in todo[start:start + batch]]
        for prompt, (ids, _, _) in zip(prompts, generate_batch(base, prompts, max_new, 0.0, None, "cpu")):
            loop.append(ids[len(prompt):].tolist())
    loop_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = [o.token_ids for o in gen.generate_many([q for _, q in todo], max_new_tokens=max_new)]
    engine_s = time.perf_counter() - t0
    return {"prompts": len(todo), "torch_loop_tokens_per_s": sum(map(len, loop)) / loop_s,
            "engine_tokens_per_s": sum(map(len, engine)) / engine_s,
            "same_replies": sum(a == b for a, b in zip(loop, engine))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.distill", description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="an ONNX artifact of the base (fp32 for the base's own replies)")
    p.add_argument("--out", type=Path, help="the replies file (.npz) to write or continue")
    p.add_argument("--data", default="sharegpt", help="'sharegpt' or a .json/.jsonl of conversations")
    p.add_argument("--skip", type=int, default=0, help="start at this training conversation (with --after: at "
                   "this reply of that file)")
    p.add_argument("--after", type=Path, metavar="FIRST.npz", help="second turns: the conversations of this "
                   "first-turn replies file continued after the base's own replies")
    p.add_argument("--n", type=int, default=3000, help="replies to make (prompts that fit --max-prompt)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=0, help="skip prompts of this many tokens or fewer (those "
                   "an earlier file took with it as --max-prompt)")
    p.add_argument("--max-prompt", type=int, default=256, help="skip longer prompts")
    p.add_argument("--parallel", type=int, default=16, help="generations side by side")
    p.add_argument("--chunk", type=int, default=256, help="rewrite the file every this many replies")
    p.add_argument("--dev-percent", type=float, default=2.0, help="the trainer's held-out share (keep it equal)")
    p.add_argument("--seed", type=int, default=0, help="the trainer's split seed (keep it equal)")
    p.add_argument("--against-torch", metavar="BASE", help="instead: time the first --n prompts through the "
                   "trainer's batched torch loop on BASE (its alias or directory) and through the engine")
    p.add_argument("--torch-batch", type=int, default=16, help="with --against-torch: the loop's batch")
    a = p.parse_args(argv)
    if not a.against_torch and (a.out is None or a.out.suffix != ".npz"):
        p.error("--out FILE.npz is required")
    import runtime
    from models.cpu import cpu_name
    gen = runtime.load(a.artifact, parallel=a.parallel)
    try:
        m = gen.manifest
        after = None if a.after is None else read(a.after)
        if after is not None and after["manifest"]["artifact_sha256"] != m["files"]["weights.bin"]:
            p.error(f"{a.after} holds another model's replies")
        settings = {"data": a.data, "skip": a.skip, "max_new_tokens": a.max_new_tokens,
                    "min_prompt": a.min_prompt, "max_prompt": a.max_prompt,
                    "artifact_sha256": m["files"]["weights.bin"], "after": None if a.after is None else a.after.name}
        todo = prompts(gen, a.data, a.skip, a.n, a.max_prompt, a.dev_percent, a.seed, after, a.min_prompt)
        if a.against_torch:
            r = against_torch(gen, a.against_torch, todo, a.max_new_tokens, a.torch_batch)
            loop, engine = r["torch_loop_tokens_per_s"], r["engine_tokens_per_s"]
            print(f"{r['prompts']} prompts x {a.max_new_tokens} tokens on {cpu_name()}: trainer's torch loop "
                  f"(batch {a.torch_batch}) {loop:.1f} tok/s, engine (parallel {a.parallel}) {engine:.1f} tok/s "
                  f"({engine / loop:.2f}x); same replies {r['same_replies']} of {r['prompts']}")
            return 0
        done = read(a.out) if a.out.exists() else None
        made_with = None if done is None else \
            {k: done["manifest"].get(k, SETTING_DEFAULTS.get(k)) for k in SETTINGS}
        if made_with is not None and made_with != settings:
            p.error(f"{a.out} was made with other settings ({made_with}): choose another --out")
        ids, prompt_ids, replies = ([], [], []) if done is None else \
            (done["conversation_ids"], done["prompts"], done["replies"])
        seconds = 0.0 if done is None else done["manifest"]["seconds"]
        if [c for c, _ in todo[:len(ids)]] != ids:
            p.error(f"{a.out} holds replies to other prompts than --data/--skip give now")
        manifest = {"format": FORMAT, **settings, "model": m["model"]["source"], "precision": m["precision"],
                    "vocab_size": m["model"]["config"]["vocab_size"], "decoding": "greedy (EAGLE-2, lossless)",
                    "prompts": "first user turn of training-split conversations, in the trainer's order"
                    if after is None else f"second user turn of {a.after.name}'s conversations, after its replies",
                    "dev_percent": a.dev_percent, "seed": a.seed, "machine": cpu_name(),
                    "command": "python -m training.distill " + " ".join(sys.argv[1:] if argv is None else argv)}
        bar = tqdm(total=len(todo), initial=len(ids), desc="replies", unit="reply", file=sys.stderr)
        for start in range(len(ids), len(todo), a.chunk):
            chunk = todo[start:start + a.chunk]
            t0 = time.perf_counter()
            for (cid, prompt), out in zip(chunk, gen.generate_many([q for _, q in chunk],
                                                                   max_new_tokens=a.max_new_tokens)):
                ids.append(cid)
                prompt_ids.append(list(prompt))
                replies.append(list(out.token_ids))
            seconds += time.perf_counter() - t0
            tokens = sum(len(r) for r in replies)
            write(a.out, {**manifest, "replies": len(replies), "reply_tokens": tokens, "seconds": round(seconds, 1),
                          "tokens_per_s": round(tokens / seconds, 1)}, ids, prompt_ids, replies)
            bar.update(len(chunk))
        bar.close()
    finally:
        gen.close()
    print(f"{len(replies)} replies in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
