"""Side-by-side benchmark: plain decoding vs EAGLE-2 at several tree sizes, in one run.

    python -m runtime.bench ARTIFACT [--prompts FILE.jsonl] [--n 8] [--max-new-tokens 128]
                                     [--trees 8/3/3,12/4/4,...] [--plot speedup.png] [--json out.json]

Each prompt is decoded by every configuration back to back (plain first), so machine drift hits
all configurations alike. Reported tokens/s count decode time after the first token (prefill
excluded), the same definition for both modes; tau = tokens per verify cycle, bonus included.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
from tqdm import tqdm

import runtime

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works in simple terms.",
    "Give me three tips for staying focused while studying.",
    "Write a Python function that checks whether a number is prime.",
    "What are the main differences between cats and dogs as pets?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a cup of green tea?",
]


def read_prompts(path: str | None, n: int) -> list[str]:
    if path is None:
        return DEFAULT_PROMPTS[:n]
    prompts = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            prompts.append(rec.get("prompt") or rec.get("turns", [None])[0])
    return prompts[:n]


def parse_trees(spec: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in item.split("/")) for item in spec.split(",") if item]


def run(gen, prompts, trees, max_new_tokens, chat=True):
    configs = [("plain", None)] + [(f"{t}/{d}/{k}", (t, d, k)) for t, d, k in trees]
    results = {name: {"tokens": 0, "seconds": 0.0, "cycles": 0, "accepted": 0} for name, _ in configs}
    for prompt in tqdm(prompts, desc="prompts", file=sys.stderr):
        ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else \
            gen.tokenizer.encode(prompt)
        reference = None
        for name, tree in configs:
            if tree is None:
                out = gen.generate(ids, max_new_tokens=max_new_tokens, speculative=False)
                reference = out.token_ids
            else:
                out = gen.generate(ids, max_new_tokens=max_new_tokens, speculative=True,
                                   total_tokens=tree[0], depth=tree[1], top_k=tree[2])
                if out.token_ids != reference:
                    raise AssertionError(f"{name}: speculative output differs from plain greedy on {prompt!r}")
            r = results[name]
            r["tokens"] += len(out.token_ids) - 1
            r["seconds"] += out.timings["total"] - out.timings["first_token"]
            r["cycles"] += len(out.accept_lengths)
            r["accepted"] += sum(out.accept_lengths)
            for key in ("draft", "verify"):
                r[key] = r.get(key, 0.0) + out.timings[key]
    plain = results["plain"]["tokens"] / results["plain"]["seconds"]
    for name, r in results.items():
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["speedup"] = r["tokens_per_s"] / plain
        r["tau"] = r["accepted"] / r["cycles"] if r["cycles"] else 0.0
    return results


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in results if n != "plain"]
    sizes = [int(n.split("/")[0]) for n in names]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [results[n]["speedup"] for n in names], "o-", label="speedup vs plain")
    ax.plot(sizes, [results[n]["tau"] for n in names], "s--", label="tau (tokens / cycle)")
    for i, (n, s) in enumerate(zip(names, sizes)):  # labels alternate above and below the line
        ax.annotate(n, (s, results[n]["speedup"]), textcoords="offset points", xytext=(3, 6 if i % 2 else -12),
                    fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    # Log scale: the small trees a CPU runs (4-12 tokens) would crowd together on a linear axis.
    ax.set_xscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("tree size (total_tokens, log scale)")
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench")
    p.add_argument("artifact")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--prompts", help="jsonl with a 'prompt' or 'turns' field per line")
    p.add_argument("--n", type=int, default=8, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--trees", default="4/2/2,8/3/3,12/4/4,16/5/4,24/5/6,40/5/8,60/5/10",
                   help="total_tokens/depth/top_k,...")
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--plot", help="write a speedup-vs-tree-size PNG here")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    gen = runtime.load(a.artifact, provider=a.provider)
    if gen.engine.draft is None:
        p.error("the artifact has no draft head")
    prompts = read_prompts(a.prompts, a.n)
    results = run(gen, prompts, parse_trees(a.trees), a.max_new_tokens, chat=not a.raw)
    m = gen.manifest
    title = f"{m['model']['source']} {m['precision']} on {a.provider}, {len(prompts)} prompts x {a.max_new_tokens} tokens"
    print(title)
    print(f"{'config':>10} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'draft ms/cyc':>13} {'verify ms/cyc':>14}")
    for name, r in results.items():
        cyc = max(r["cycles"], 1)
        print(f"{name:>10} {r['tokens_per_s']:8.1f} {r['speedup']:8.2f} {r['tau']:6.2f} "
              f"{1e3 * r['draft'] / cyc:13.1f} {1e3 * r['verify'] / cyc:14.1f}")
    if a.plot:
        plot(results, a.plot, title)
        print(f"plot: {a.plot}")
    if a.json:
        Path(a.json).write_text(json.dumps({"title": title, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
