"""Choose the draft tree for the machine the runtime runs on.

    python -m runtime tune ARTIFACT [--provider cpu] [--prompts FILE.jsonl] [--n 6] [--max-new-tokens 96]
                                    [--depths 0,1,2,3,4] [--top-ks 1,2,3,4] [--plot tune.png]
    python -m runtime tune ARTIFACT --batch 16      # generations side by side: when plain steps win

What a tree is worth depends on the machine: the verify step's cost grows with the tree at a rate
set by the kernels and the cores, the draft's with depth and branching. This measures both here,
measures acceptance on a few prompts, predicts tokens/s = tau / (verify + draft + host) for every
tree, confirms the best few by decoding side by side with plain decoding, and records the winner
in ARTIFACT/tuning.json, which runtime.load uses by default for that provider.

With many generations decoded side by side (runtime.load(..., parallel=N)), a step's extra tree rows
compete with other generations' rows for the cores: `--batch N` decodes the prompts 1, 2, 4 ... N at
a time with the default tree and with plain steps, and records from how many in flight plain steps
got more tokens through; the scheduler then drafts no trees at that load.

One speculative run per (depth, top_k) gives tau for every total_tokens at once: greedy output
does not depend on the tree, and a tree of n tokens is the n - 1 best-scored nodes of the pool, so
a cycle's acceptance with n tokens is the part of its accepted path that lies among those nodes.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from eagle2 import tree_from_parents
from models.cpu import cpu_name

from .generation import DEFAULT_LOOKUP, Decoder, as_tree, tree_label
from .prompts import load_prompts
from .step_costs import load_or_probe
from .tuning import write_tuning

CONFIRM = 3            # predicted-best trees decoded for real
MAX_TOTAL = 32         # largest tree considered
COST_ROWS = (1, 2, 4, 8, 16, 32)
MAX_DRAFT_TOTAL = 64   # the largest tree whose draft cost --draft-depths measures
TABLE_REPS = 10        # steps a size when the step-cost table is measured again (runtime/step_costs.py)


class RecordingDecoder(Decoder):
    """A Decoder that keeps, per cycle, the verified tree and the accepted node indices."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cycles = []

    def _accept(self, tree, logits):
        accepted, bonus = super()._accept(tree, logits)
        self.cycles.append((tree, accepted))
        return accepted, bonus


def accepted_within(tree, accepted: np.ndarray, total: int) -> int:
    """Tokens the cycle would have produced had only the total - 1 best-scored nodes been verified."""
    rank = np.empty(len(tree.tokens) - 1, np.int64)
    rank[np.argsort(-tree.scores[1:], kind="stable")] = np.arange(len(rank))
    n = 1
    for node in accepted[1:]:
        if rank[node - 1] >= total - 1:
            break
        n += 1
    return n


def acceptance(gen, prompts: list[list[int]], depth: int, top_k: int, max_new: int,
               max_total: int = MAX_TOTAL) -> dict:
    """tau for every tree size up to max_total of this (depth, top_k), and the draft and host seconds
    per cycle."""
    s = gen._settings(max_new, True, max_total, depth, top_k, lookup=0)
    taus, cycles, draft, host = np.zeros(max_total + 1), 0, 0.0, 0.0
    for ids in prompts:
        dec = RecordingDecoder(gen.engine, ids, s, gen.stop_ids)
        start = time.perf_counter()
        for _ in dec.tokens():
            pass
        t = gen.engine.timings
        draft += t["draft"]
        host += time.perf_counter() - start - sum(t.values())
        for tree, accepted in dec.cycles:
            taus[1:] += [accepted_within(tree, accepted, n) for n in range(1, max_total + 1)]
        cycles += len(dec.cycles)
    return {"tau": (taus / max(cycles, 1)).tolist(), "draft_s": draft / max(cycles, 1),
            "host_s": host / max(cycles, 1), "cycles": cycles}


def verify_costs(gen, sizes: list[int], context: int, reps: int = 15) -> dict[int, float]:
    """Seconds per verify step by tree size at `context` cached tokens (a chain: the cost depends
    on the size only), sizes interleaved so machine drift hits all alike; the median of reps."""
    e = gen.engine
    context = min(context, e.max_length - max(sizes) - 1)
    e.start(context)
    prompt = np.arange(context, dtype=np.int64) % min(1000, gen.vocab_size - 10) + 10
    for start in range(0, context, 128):
        e.prefill(prompt[start:start + 128], start)
    trees = {n: tree_from_parents(np.arange(10, 10 + n), np.arange(n) - 1) for n in sizes}
    times = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            t0 = time.perf_counter()
            e.verify(trees[n], context)
            times[n].append(time.perf_counter() - t0)
    return {n: float(np.median(v)) for n, v in times.items()}


def measured_speed(gen, prompts, trees, max_new) -> dict:
    """Decode tokens/s of plain decoding and of each tree on the same prompts, interleaved."""
    totals = {t: [0, 0.0] for t in [None, *trees]}
    for ids in prompts:
        reference = None
        for t in totals:
            if t is None:
                out = gen.generate(ids, max_new_tokens=max_new, speculative=False)
                reference = out.token_ids
            else:
                out = gen.generate(ids, max_new_tokens=max_new, **as_tree(t))
                if out.token_ids != reference:
                    raise AssertionError(f"tree {t}: speculative output differs from plain decoding")
            totals[t][0] += len(out.token_ids) - 1
            totals[t][1] += out.timings["total"] - out.timings["first_token"]
    return {t: n / s for t, (n, s) in totals.items()}


def tune(gen, prompts: list[list[int]], depths, top_ks, max_new: int) -> dict:
    configs = [(d, k) for d in depths for k in top_ks]
    runs = {}
    for i, (d, k) in enumerate(configs):
        # Progress without tqdm, which the runtime's core install lacks.
        print(f"acceptance by (depth, top_k): {d}/{k}, {i + 1} of {len(configs)}", file=sys.stderr)
        runs[(d, k)] = acceptance(gen, prompts, d, k, max_new)
    context = int(np.mean([len(p) for p in prompts])) + max_new // 2
    verify = verify_costs(gen, list(range(1, MAX_TOTAL + 1)), context)
    predicted = []
    for (d, k), r in runs.items():
        for n in range(2, min(MAX_TOTAL, k + d * k * k + 1) + 1):
            cycle = verify[n] + r["draft_s"] + r["host_s"]
            predicted.append({"total_tokens": n, "depth": d, "top_k": k, "tau": r["tau"][n],
                              "cycle_ms": 1e3 * cycle, "tokens_per_s": r["tau"][n] / cycle})
    predicted.sort(key=lambda p: -p["tokens_per_s"])
    # Each candidate is confirmed with and without the lookup branch, whose worth (rows it adds
    # against tokens it lands) only a real decode shows.
    best = [(p["total_tokens"], p["depth"], p["top_k"], lookup) for p in predicted[:CONFIRM]
            for lookup in (0, DEFAULT_LOOKUP)]
    speed = measured_speed(gen, prompts, best, max_new)
    plain = speed.pop(None)
    winner = max(speed, key=speed.get)
    tree = as_tree(winner) if speed[winner] > plain else None
    return {"tree": tree, "machine": cpu_name(), "date": time.strftime("%Y-%m-%d"),
            "plain_tokens_per_s": plain,
            "confirmed": [{"tree": tree_label(as_tree(t)), "tokens_per_s": v, "speedup": v / plain}
                          for t, v in speed.items()],
            "verify_ms": {str(n): 1e3 * v for n, v in verify.items()},
            "draft_ms": {f"{d}/{k}": 1e3 * r["draft_s"] for (d, k), r in runs.items()},
            "predicted": predicted[:20]}


def batch_levels(parallel: int) -> list[int]:
    """1, 2, 4 ... up to parallel, parallel included."""
    levels = [1]
    while levels[-1] * 2 < parallel:
        levels.append(levels[-1] * 2)
    return levels + [parallel] if parallel > 1 else levels


def batch_speeds(gen, prompts: list[list[int]], max_new: int, levels: list[int]) -> list[dict]:
    """Generated tokens/s with c generations in flight (c client threads, 2c requests, the prompts
    in turn) for each c of levels, with the default tree and with plain steps, on a Generator loaded
    with parallel >= max(levels) whose scheduler drafts trees at every load. Greedy replies of the
    two must be equal."""
    out = []
    for c in levels:
        requests = [prompts[i % len(prompts)] for i in range(max(2 * c, len(prompts)))]
        speed, replies = {}, {}
        for mode, speculative in (("trees", True), ("plain", False)):
            start = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                got = list(pool.map(lambda p: gen.generate(p, max_new_tokens=max_new, speculative=speculative),
                                    requests))
            speed[mode] = sum(len(g.token_ids) for g in got) / (time.perf_counter() - start)
            replies[mode] = [g.token_ids for g in got]
        if replies["trees"] != replies["plain"]:
            raise AssertionError(f"{c} in flight: speculative replies differ from plain decoding")
        out.append({"sequences": c, "trees_tokens_per_s": speed["trees"], "plain_tokens_per_s": speed["plain"]})
        print(f"{c:>3} in flight: trees {speed['trees']:.1f} tok/s, plain {speed['plain']:.1f} tok/s",
              file=sys.stderr)
    return out


def plain_threshold(levels: list[dict]) -> int | None:
    """The fewest generations in flight from which plain steps win, plain being faster at every larger
    load measured: where log(plain / trees) crosses zero, interpolated in log2 of the load between the
    last level where trees were as fast and the first where plain was faster."""
    first = None
    for i in reversed(range(len(levels))):
        if levels[i]["plain_tokens_per_s"] <= levels[i]["trees_tokens_per_s"]:
            break
        first = i
    if first is None or first == 0:
        return None if first is None else levels[0]["sequences"]
    lo, hi = levels[first - 1], levels[first]
    gain = [math.log(v["plain_tokens_per_s"] / v["trees_tokens_per_s"]) for v in (lo, hi)]
    x = math.log2(lo["sequences"]) + gain[0] / (gain[0] - gain[1]) * math.log2(hi["sequences"] / lo["sequences"])
    return min(hi["sequences"], max(lo["sequences"] + 1, math.ceil(2 ** x)))


def tune_batch(gen, prompts: list[list[int]], max_new: int) -> dict:
    """Measure batch_speeds up to the Generator's parallel generations; the threshold and the figures."""
    if gen.scheduler is None or not gen.speculative_default:
        raise ValueError("nothing to choose: " + ("this artifact's generations decode one at a time here"
                         if gen.scheduler is None else "its default here is plain decoding"))
    gen.scheduler.plain_from = None  # measure trees at every load, whatever an earlier tuning found
    levels = batch_speeds(gen, prompts, max_new, batch_levels(gen.engine.sequences))
    return {"tree": tree_label(gen.tree_defaults), "plain_from": plain_threshold(levels), "machine": cpu_name(),
            "date": time.strftime("%Y-%m-%d"), "max_new_tokens": max_new, "levels": levels}


def step_costs(gen, prompt: list[int], context: int, rows=COST_ROWS, draft_depths=(), draft_top_k: int = 10) -> dict:
    """Verify seconds by rows and the draft's seconds per cycle of the artifact's default tree (and
    of trees of each of `draft_depths` at `draft_top_k`), with plain decoding's seconds a token:
    what a tree costs here, without the acceptance decoding that tune() runs."""
    verify = verify_costs(gen, sorted({1, *rows}), context, reps=5)  # one row: what the others are against

    def draft_ms(**tree) -> float:
        out = gen.generate(prompt, max_new_tokens=16, lookup=0, **tree)
        return 1e3 * out.timings["draft"] / max(1, len(out.accept_lengths))

    plain = gen.generate(prompt, max_new_tokens=16, speculative=False)
    result = {"machine": cpu_name(), "date": time.strftime("%Y-%m-%d"), "context": context,
              "verify_ms": {str(n): 1e3 * v for n, v in verify.items()},
              "verify_vs_one_row": {str(n): v / verify[1] for n, v in verify.items()},
              "plain_ms_per_token": 1e3 * (plain.timings["total"] - plain.timings["first_token"])
              / max(1, len(plain.token_ids) - 1),
              "tree": tree_label(gen.tree(lookup=0)), "draft_ms_per_cycle": draft_ms()}
    if draft_depths:
        result["draft_top_k"] = draft_top_k
        result["draft_ms_by_depth"] = {str(d): draft_ms(total_tokens=min(MAX_DRAFT_TOTAL, d * draft_top_k + 1),
                                                        depth=d, top_k=draft_top_k) for d in draft_depths}
    return result


def acceptance_seconds(one_row_s: float, n_prompts: int, max_new: int, configs: int) -> float:
    """What tune()'s acceptance runs would take at about one plain step a token (each cycle's
    verify costs more than a step, and lands more than one token)."""
    return one_row_s * n_prompts * max_new * (configs + 2 * CONFIRM + 1)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    by_shape: dict[tuple, list] = {}
    for p in result["predicted"]:
        by_shape.setdefault((p["depth"], p["top_k"]), []).append(p)
    for (d, k), ps in sorted(by_shape.items()):
        ps.sort(key=lambda p: p["total_tokens"])
        ax.plot([p["total_tokens"] for p in ps], [p["tokens_per_s"] / result["plain_tokens_per_s"] for p in ps],
                "o-", ms=3, label=f"depth {d}, top_k {k}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("tree size (total_tokens)")
    ax.set_ylabel("predicted speedup vs plain decoding")
    ax.set_title(f"{result['machine']}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime tune")
    p.add_argument("artifact")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--prompts", default="builtin", help="builtin, gsm8k[:N] or a .jsonl (keep the prompts you "
                   "evaluate on out of tuning)")
    p.add_argument("--n", type=int, default=6, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--depths", default="0,1,2,3,4")
    p.add_argument("--top-ks", default="1,2,3,4")
    p.add_argument("--plot", help="write predicted speedup against tree size here")
    p.add_argument("--costs-only", action="store_true", help="measure the verify cost by rows and the draft cost, "
                   "not acceptance (random-weight checkpoints: their acceptance means nothing)")
    p.add_argument("--budget-minutes", type=float, default=30, help="measure costs only when the acceptance runs "
                   "would take longer than this (large models on few cores; default 30)")
    p.add_argument("--json", help="with costs only: write the costs here")
    p.add_argument("--rows", default=",".join(map(str, COST_ROWS)), help="with costs only: verify step sizes to time")
    p.add_argument("--draft-depths", default="", help="with costs only: also time the draft of trees of these depths "
                   "(at --draft-top-k), e.g. 1,2,3,4,5,6")
    p.add_argument("--draft-top-k", type=int, default=10)
    p.add_argument("--batch", type=int, metavar="N", help="instead of the tree: decode 1, 2, 4 ... N generations side "
                   "by side with the default tree and with plain steps, and record from how many plain steps win")
    a = p.parse_args(argv)
    import runtime
    if a.batch:
        return _main_batch(a)
    gen = runtime.load(a.artifact, provider=a.provider)
    if gen.engine.draft is None:
        p.error("the artifact has no draft head: there is no tree to tune")
    prompts = [gen.tokenizer.apply_chat_template([{"role": "user", "content": q.text}])
               for q in load_prompts(a.prompts)[: a.n]]
    depths, top_ks = [int(v) for v in a.depths.split(",")], [int(v) for v in a.top_ks.split(",")]
    context = int(np.mean([len(q) for q in prompts])) + a.max_new_tokens // 2
    if not a.costs_only:
        one_row = verify_costs(gen, [1], context, reps=3)[1]
        need = acceptance_seconds(one_row, len(prompts), a.max_new_tokens, len(depths) * len(top_ks))
        if need > 60 * a.budget_minutes:
            print(f"acceptance on {len(prompts)} prompts x {a.max_new_tokens} tokens for {len(depths) * len(top_ks)} "
                  f"tree shapes would take about {need / 3600:.1f} h here ({1e3 * one_row:.0f} ms a one-token step): "
                  "measuring costs only, choosing no tree (fewer --n / --max-new-tokens / --depths / --top-ks, or a "
                  "larger --budget-minutes, to tune)", file=sys.stderr)
            a.costs_only = True
    if a.costs_only:
        costs = step_costs(gen, prompts[0], context, [int(n) for n in a.rows.split(",")],
                           [int(d) for d in a.draft_depths.split(",") if d], a.draft_top_k)
        print(f"verify step by rows on {costs['machine']} (context {context}):")
        for n, ms in costs["verify_ms"].items():
            print(f"  {n:>2} rows: {ms:8.1f} ms ({costs['verify_vs_one_row'][n]:.2f}x one row)")
        print(f"plain decoding: {costs['plain_ms_per_token']:.1f} ms a token")
        print(f"draft: {costs['draft_ms_per_cycle']:.1f} ms a cycle of tree {costs['tree']}")
        for d, ms in costs.get("draft_ms_by_depth", {}).items():
            print(f"draft: {ms:.1f} ms a cycle at depth {d}, top_k {a.draft_top_k}")
        if a.json:
            Path(a.json).write_text(json.dumps(costs, indent=2) + "\n")
        return 0
    result = tune(gen, prompts, depths, top_ks, a.max_new_tokens)
    path = write_tuning(a.artifact, a.provider, **result)
    print(load_or_probe(a.artifact, a.provider, gen.engine, fresh=True, reps=TABLE_REPS).describe()
          + " (what calls naming no tree size it by)")
    print(f"plain decoding: {result['plain_tokens_per_s']:.1f} tok/s on {result['machine']}")
    for c in result["confirmed"]:
        print(f"tree {c['tree']:>8}: {c['tokens_per_s']:.1f} tok/s ({c['speedup']:.2f}x)")
    chosen = "plain decoding (no tree beat it here)" if result["tree"] is None else \
        "tree " + tree_label(result["tree"])
    print(f"chosen for provider {a.provider}: {chosen}; written to {path}")
    if a.plot:
        plot(result, a.plot)
        print(f"plot: {a.plot}")
    return 0


def _main_batch(a) -> int:
    import runtime
    gen = runtime.load(a.artifact, provider=a.provider, parallel=a.batch)
    try:
        prompts = [gen.tokenizer.apply_chat_template([{"role": "user", "content": q.text}])
                   for q in load_prompts(a.prompts)[: a.n]]
        result = tune_batch(gen, prompts, a.max_new_tokens)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        gen.close()
    path = write_tuning(a.artifact, a.provider, batch=result)
    when = (f"plain steps from {result['plain_from']} generations side by side" if result["plain_from"]
            else "trees at every load measured")
    print(f"chosen for provider {a.provider}, tree {result['tree']}: {when}; written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
