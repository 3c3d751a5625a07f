"""How much of a conversation's prompts prefix reuse can serve at each key granularity, and what
copying a hit in costs: the measurement behind runtime/prefix_cache.BLOCK_TOKENS.

    python -m tools.prefix_granularity ARTIFACT [--conversations 4] [--turns 4] [--system-tokens 500]
                                       [--max-tokens 96] [--blocks 1,16,32,64] [--json out.json]

Runs the load benchmark's conversations (runtime/conversations.py) in process, greedy, each turn's
prompt the chat template over the history with the earlier replies' text, as a server sees it. For
every granularity B it counts the prompt tokens reusable from everything generated before (prompt
and generated ids), rounded down to B and leaving the last token (B = 1: a radix tree over token ids).
It then times copying the longest prompt's hit into a cache slot with blocks of each size (a radix
tree, B = 1, would copy per node, not per token: not timed).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import runtime
from models.cpu import cpu_name
from runtime.conversations import system_prompt, user_turns
from runtime.prefix_cache import PrefixCache


def conversation_ids(gen, conversations: int, turns: int, system_tokens: int, max_tokens: int):
    """[(prompt ids, generated ids)] of every turn, conversations one after another."""
    system, out = system_prompt(gen.tokenizer, system_tokens), []
    for users in user_turns(conversations, turns):
        messages = [{"role": "system", "content": system}]
        for content in users:
            messages.append({"role": "user", "content": content})
            prompt = gen.tokenizer.apply_chat_template(messages)
            reply = gen.generate(prompt, max_new_tokens=max_tokens)
            out.append((prompt, reply.token_ids))
            messages.append({"role": "assistant", "content": reply.text})
    return out


def reusable(turns, block: int) -> tuple[int, int]:
    """(prompt tokens reusable at granularity `block`, prompt tokens): each prompt against every
    earlier turn's prompt + generated ids (what their caches held), all kept."""
    stored, hit, total = [], 0, 0
    for prompt, generated in turns:
        best = 0
        for seq in stored:
            n = min(len(seq), len(prompt) - 1)
            same = np.flatnonzero(np.asarray(seq[:n]) != np.asarray(prompt[:n]))
            best = max(best, int(same[0]) if len(same) else n)
        hit += best // block * block
        total += len(prompt)
        stored.append(prompt + generated[:-1])  # the last token is never in the cache
    return hit, total


def restore_ms(gen, tokens: list[int], block: int, repeats: int = 20) -> float:
    """Milliseconds to copy a hit of `tokens` into the solo slot, stored in blocks of `block`."""
    engine = gen.engine
    engine.prefix = PrefixCache(2**34, block)
    try:
        gen.generate(tokens, max_new_tokens=1)
        hit = engine.prefix.lookup(tokens + [0])
        start = time.perf_counter()
        for _ in range(repeats):
            engine.restore_prefix(engine.solo, hit)
        return 1e3 * (time.perf_counter() - start) / repeats
    finally:
        engine.prefix = None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.prefix_granularity", description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--blocks", default="1,16,32,64")
    p.add_argument("--json")
    a = p.parse_args(argv)
    gen = runtime.load(a.artifact, prefix_cache_mb=0)
    turns = conversation_ids(gen, a.conversations, a.turns, a.system_tokens, a.max_tokens)
    longest = max((prompt for prompt, _ in turns), key=len)
    rows = []
    for block in (int(b) for b in a.blocks.split(",")):
        hit, total = reusable(turns, block)
        # B = 1 stands for a radix tree, which would copy per node (a run of tokens), not per token: not timed.
        rows.append({"block_tokens": block, "reused": hit, "prompt_tokens": total,
                     "restore_ms": restore_ms(gen, longest, block) if block > 1 else None,
                     "restore_tokens": len(longest) // block * block})
    print(f"{len(turns)} turns, {cpu_name()}\n\n| block tokens | prompt tokens reused | copying a hit in |\n|---|---|---|")
    for r in rows:
        copy = "-" if r["restore_ms"] is None else f"{r['restore_ms']:.1f} ms for {r['restore_tokens']} tokens"
        print(f"| {r['block_tokens']} | {r['reused']} of {r['prompt_tokens']} "
              f"({100 * r['reused'] / r['prompt_tokens']:.1f} %) | {copy} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"artifact": a.artifact, "machine": cpu_name(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
