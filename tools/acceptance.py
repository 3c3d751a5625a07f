"""Acceptance (tau: tokens per verify cycle, bonus token included) of artifacts' heads by prompt
category, greedy, on the replies the base really gives (generation ends at its stop tokens).

    python -m tools.acceptance ARTIFACT [ARTIFACT ...] [--prompts mtbench,gsm8k:40]
                                 [--trees 60/5/10,tuned] [--max-new-tokens 128] [--report tau.md] [--json tau.json]

Tau does not depend on the machine or its load (greedy acceptance is a property of the head and
the base's arithmetic), so this can run next to other work; speed belongs to runtime.bench.
The mean of a category is the ratio of its sums (accepted tokens / cycles), as bench reports it.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

import runtime
from runtime.bench import parse_trees
from runtime.generation import as_tree, tree_label
from runtime.prompts import load_prompts


def measure(path: str, provider: str, prompt_sets: list[str], tree_spec: str, max_new: int,
            threads: int | None = None) -> dict:
    """{tree label: {category: [accepted tokens, cycles]}} for one artifact."""
    gen = runtime.load(path, provider=provider, threads=threads)
    if gen.engine.draft is None:
        raise SystemExit(f"{path} has no draft head")
    prompts = [p for spec in prompt_sets for p in load_prompts(spec)]
    trees = parse_trees(tree_spec, gen)
    sums = {t: defaultdict(lambda: [0, 0]) for t in trees}
    for q in tqdm(prompts, desc=f"tau {Path(path).name}", file=sys.stderr):
        ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": q.text}])
        for t in trees:
            out = gen.generate(ids, max_new_tokens=max_new, **as_tree(t))
            s = sums[t][q.category]
            s[0] += sum(out.accept_lengths)
            s[1] += len(out.accept_lengths)
    return {tree_label(as_tree(t)): dict(v) for t, v in sums.items()}


def category_tau(sums: dict) -> dict[str, float]:
    """{category: tau, ..., "all": tau} from {category: [accepted tokens, cycles]}."""
    out = {c: a / n for c, (a, n) in sums.items() if n}
    total = [sum(v[i] for v in sums.values()) for i in (0, 1)]
    out["all"] = total[0] / total[1]
    return out


def markdown(results: dict, header: str) -> str:
    categories = list(dict.fromkeys(c for trees in results.values() for cats in trees.values() for c in cats))
    lines = [header, "", "| head | tree | " + " | ".join(categories) + " | all |",
             "|---|---|" + "---:|" * (len(categories) + 1)]
    for path, trees in results.items():
        for tree, cats in trees.items():
            tau = category_tau(cats)
            cells = [f"{tau[c]:.2f}" if c in tau else "" for c in categories]
            lines.append(f"| {Path(path).name} | {tree} | " + " | ".join(cells) + f" | {tau['all']:.2f} |")
    return "\n".join(lines) + "\n"


def publish(report: str, payload: dict, report_path: str | None, json_path: str | None) -> None:
    """Print the Markdown report; write it and the JSON payload where asked."""
    print(report)
    if report_path:
        Path(report_path).write_text(report)
    if json_path:
        Path(json_path).write_text(json.dumps(payload, indent=2) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--prompts", default="mtbench", help="comma-separated prompt sets: builtin, mtbench[:K], "
                   "gsm8k[:N], FILE.jsonl")
    p.add_argument("--trees", default="60/5/10,tuned", help="'tuned' and/or total_tokens/depth/top_k[+lookup] items")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    p.add_argument("--report", help="write the Markdown table here")
    p.add_argument("--json", help="write the sums here")
    a = p.parse_args(argv)
    results = {path: measure(path, a.provider, a.prompts.split(","), a.trees, a.max_new_tokens, a.threads)
               for path in a.artifacts}
    header = (f"tau by category ({a.prompts}, first turns, up to {a.max_new_tokens} new tokens, greedy); "
              f"python -m tools.acceptance {' '.join(argv if argv is not None else sys.argv[1:])}")
    publish(markdown(results, header), {"header": header, "results": results}, a.report, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
