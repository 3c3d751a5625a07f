"""Throughput of generations decoded side by side (runtime/batch.py) against the same requests one
after another, in one run on one machine: generated tokens per second of wall time by concurrency,
with and without a row budget shared across the batch, each reply checked equal to its reply alone.

    python -m tools.batch_bench ARTIFACT [--prompts mtbench:2] [--concurrency 1,2,4,8]
                                  [--row-budgets none,16,32] [--plain-from tuned,1] [--fit-slack 128,never]
                                  [--max-new-tokens 96] [--json out.json]
    python -m tools.batch_bench ARTIFACT --capacities 64,128,256,512 [--concurrency 1,16]

Concurrency c keeps c requests in flight (c client threads) on one Generator loaded with
parallel = the largest c; "one at a time" is the same requests through generate() on a Generator
loaded without it. --plain-from adds runs whose generations take plain steps from that many in
flight (1: always; "tuned": what `runtime tune --batch` recorded); --fit-slack runs each of them
again with other thresholds for shrinking the base's caches when a generation ends ("never": only
once none is left). Greedy. --capacities instead times one plain base step (a row each) of that
many sequences with their caches at each capacity: what reading the caches costs a step. Nothing
else may run on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

import runtime
from eagle2 import tree_from_parents
from models.cpu import cpu_name
from runtime.engine import FIT_SLACK
from runtime.prompts import load_prompts


def _budget(text: str) -> int | None:
    return None if text == "none" else int(text)


def _slack(text: str) -> int | None:
    return None if text == "never" else int(text)


def run(artifact: str, prompt_spec: str, levels: list[int], budgets: list[int | None], max_new: int,
        threads: int | None = None, plain_from: tuple = (), fit_slacks: tuple = (FIT_SLACK,)) -> dict:
    """plain_from: values of the scheduler's plain_from to run besides the budgets (with no budget),
    "tuned" for the artifact's tuning. fit_slacks: the engine's fit_slack for each of those runs."""
    alone = runtime.load(artifact, threads=threads)
    prompts = [alone.tokenizer.apply_chat_template([{"role": "user", "content": p.text}])
               for p in load_prompts(prompt_spec)]
    start = time.perf_counter()
    want = [alone.generate(p, max_new_tokens=max_new) for p in tqdm(prompts, desc="one at a time", file=sys.stderr)]
    sequential_s = time.perf_counter() - start
    tokens = sum(len(w.token_ids) for w in want)
    rows = [{"mode": "one at a time", "concurrency": 1, "row_budget": None, "seconds": sequential_s,
             "tokens_per_s": tokens / sequential_s, "vs_one_at_a_time": 1.0, "rows_per_step": None}]
    del alone
    configs = [(budget, None, slack) for budget in budgets for slack in fit_slacks] + \
        [(None, value, slack) for value in plain_from for slack in fit_slacks]
    for budget, plain, slack in configs:
        gen = runtime.load(artifact, threads=threads, parallel=max(levels), row_budget=budget)
        gen.engine.fit_slack = slack
        if plain != "tuned":
            gen.scheduler.plain_from = plain
        elif gen.scheduler.plain_from is None:
            raise SystemExit(f"{artifact} has no batch tuning for its tree: run `python -m runtime tune {artifact} "
                             f"--batch {max(levels)}` first")
        plain = gen.scheduler.plain_from
        for c in levels:
            steps, step_rows = gen.scheduler.steps, gen.scheduler.rows
            for key in gen.engine.timings:
                gen.engine.timings[key] = 0.0
            read, used = gen.engine.cache_positions["read"], gen.engine.cache_positions["used"]
            start = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                got = list(tqdm(pool.map(lambda p: gen.generate(p, max_new_tokens=max_new), prompts),
                                total=len(prompts), desc=f"{c} side by side, budget {budget}, plain from {plain}",
                                file=sys.stderr))
            seconds = time.perf_counter() - start
            mismatched = sum(g.token_ids != w.token_ids for g, w in zip(got, want))
            if mismatched:
                raise SystemExit(f"{mismatched} replies differ from their reply alone (concurrency {c})")
            ran = gen.scheduler.steps - steps
            graphs = dict(gen.engine.timings)
            # per base step: the graphs' time, and the rest (Python: trees, acceptance, scheduling)
            per_step = {f"{k}_ms": 1e3 * v / ran for k, v in graphs.items()}
            per_step["host_ms"] = 1e3 * (seconds - sum(graphs.values())) / ran
            rows.append({"mode": "side by side", "concurrency": c, "row_budget": budget, "plain_from": plain,
                         "fit_slack": gen.engine.fit_slack, "seconds": seconds,
                         "cache_read_per_step": (gen.engine.cache_positions["read"] - read) / ran,
                         "cache_used_per_step": (gen.engine.cache_positions["used"] - used) / ran,
                         "tokens_per_s": tokens / seconds, "vs_one_at_a_time": sequential_s / seconds,
                         "rows_per_step": (gen.scheduler.rows - step_rows) / ran, **per_step})
        gen.close()
    return {"artifact": str(artifact), "machine": cpu_name(), "prompts": prompt_spec, "requests": len(prompts),
            "max_new_tokens": max_new, "generated_tokens": tokens, "rows": rows}


def step_costs(artifact: str, levels: list[int], capacities: list[int], threads: int | None = None,
               repeats: int = 20) -> dict:
    """Median ms of one base step holding one row of each of n sequences whose caches are read at
    each capacity (their contexts fill it), for n in levels."""
    gen = runtime.load(artifact, threads=threads, parallel=max(levels))
    engine = gen.engine
    seqs = [engine.open_sequence() for _ in range(max(levels))]
    root = tree_from_parents([0], [-1])
    rows = []
    for n in levels:
        for capacity in capacities:
            parts = [engine.verify_rows(root, capacity - 1, seq) for seq in seqs[:n]]
            engine.base.reserve(1, shrink=True)
            times = []
            for _ in range(repeats + 3):
                start = time.perf_counter()
                engine.run(parts)
                times.append(time.perf_counter() - start)
            rows.append({"sequences": n, "capacity": engine.base.capacity, "step_ms": 1e3 * statistics.median(times[3:])})
    gen.close()
    return {"artifact": str(artifact), "machine": cpu_name(), "rows": rows}


def costs_table(result: dict) -> str:
    capacities = list(dict.fromkeys(r["capacity"] for r in result["rows"]))
    lines = [f"ms a plain base step (a row a sequence) by cache capacity; {result['machine']}", "",
             "| sequences | " + " | ".join(str(c) for c in capacities) + " |", "|---|" + "---:|" * len(capacities)]
    for n in dict.fromkeys(r["sequences"] for r in result["rows"]):
        cells = [f"{r['step_ms']:.1f}" for r in result["rows"] if r["sequences"] == n]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(result: dict) -> str:
    lines = [f"{result['requests']} requests ({result['prompts']}), {result['max_new_tokens']} new tokens at most, "
             f"greedy, {result['generated_tokens']} tokens in all; {result['machine']}", "",
             "| decoding | concurrency | row budget | plain steps from | cache fit slack | rows a base step "
             "| cache positions read / in use a base step | prefill / draft / verify / host ms a step | tokens/s "
             "| vs one at a time |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        per_step = f"{r['rows_per_step']:.1f}" if r["rows_per_step"] else "-"
        split = " / ".join(f"{r[k + '_ms']:.1f}" for k in ("prefill", "draft", "verify", "host")) \
            if "host_ms" in r else "-"
        alone = r["mode"] == "one at a time"
        budget = "-" if alone else (r["row_budget"] or "none")
        plain = "-" if alone else (r.get("plain_from") or "never")
        slack = "-" if alone else "never" if r.get("fit_slack") is None else r["fit_slack"]
        cache = f"{r['cache_read_per_step']:.0f} / {r['cache_used_per_step']:.0f}" if "cache_read_per_step" in r else "-"
        lines.append(f"| {r['mode']} | {r['concurrency']} | {budget} | {plain} | {slack} | {per_step} | {cache} | "
                     f"{split} | {r['tokens_per_s']:.1f} | {r['vs_one_at_a_time']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.batch_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--prompts", default="mtbench:2", help="a prompt set (runtime/prompts.py)")
    p.add_argument("--concurrency", default="1,2,4,8", help="requests in flight, comma-separated")
    p.add_argument("--row-budgets", default="none", help="tree rows a step for all ('none': each its own tree)")
    p.add_argument("--plain-from", default="", help="also run with plain steps from this many generations in "
                   "flight, comma-separated (1: always plain; 'tuned': the artifact's `runtime tune --batch`)")
    p.add_argument("--fit-slack", default=str(FIT_SLACK), help="run each with these thresholds (positions) for "
                   "shrinking the base's caches when a generation ends, comma-separated ('never': only once none "
                   "is left)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--capacities", help="instead: time a plain base step of each concurrency's sequences at these "
                   "cache capacities, comma-separated")
    p.add_argument("--threads", type=int)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    plain = tuple(v if v == "tuned" else int(v) for v in a.plain_from.split(",") if v)
    if a.capacities:
        result = step_costs(a.artifact, levels, [int(c) for c in a.capacities.split(",")], a.threads)
        print(costs_table(result))
    else:
        result = run(a.artifact, a.prompts, levels, [_budget(b) for b in a.row_budgets.split(",")],
                     a.max_new_tokens, a.threads, plain, tuple(_slack(v) for v in a.fit_slack.split(",")))
        print(table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
