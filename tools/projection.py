"""Projected EAGLE-2 speedup on a device, from tau measured elsewhere and step costs measured there.

Greedy tau belongs to the model, the head and the prompts, not to the device: verification keeps
plain decoding's output, and which drafted tokens match it does not depend on how fast either runs
(up to near-ties that another precision may break differently). So tau measured on the CPU with the
real SmolLM2-135M head (tau_file()), with the verify and draft costs measured on a GPU for a random
model of SmolLM2's shape (tools/gpu_check.py), projects tokens/s = tau / (verify + draft + host)
per cycle. A projection, and labelled so wherever it is shown: nothing decodes with the real head on
the GPU.

    python -m tools.projection ARTIFACT [--out FILE]   # re-measure tau (a SmolLM2-135M artifact, CPU)

Large models (docs/large-models.md): a random-weight checkpoint measures what a tree costs at its
size (runtime tune --costs-only), but not what a tree lands. Published acceptance gives that, for
one tree: the EAGLE-2 paper's tau for LLaMA2-Chat 7B on MT-bench, at its 60/5/10 tree. Other trees
are estimated with a model of the draft (modelled_tau): the base's next token is the draft's
rank-r candidate with probability q1 * beta^(r - 1) at every node, the shape beta fitted to the
shipped SmolLM2 head's measured curves (which the model must reproduce: fit_rank_model reports
its error), q1 to the published figure.

    python -m tools.projection --costs COSTS.json[,COSTS2.json] --report FILE.md [--json FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPES = ((2, 2), (3, 4), (5, 8), (6, 10))  # (depth, top_k) measured: tau for every tree size of each
MAX_TOTAL = 64


def head_dir() -> Path:
    """The shipped SmolLM2-135M head's directory. models.registry imports torch: imported here, on use,
    so that project() loads without it."""
    from models.registry import SHIPPED_HEADS
    return SHIPPED_HEADS / "smollm2-135m"


def tau_file() -> Path:
    return head_dir() / "tau_greedy.json"


def measure_tau(artifact: str, n: int = 6, max_new: int = 96) -> dict:
    """Greedy tau for every tree size (up to MAX_TOTAL) of every shape, on the head's held-out prompts."""
    import runtime
    from runtime.prompts import load_prompts
    from runtime.tune import acceptance
    head = head_dir()
    gen = runtime.load(artifact)
    prompts = [gen.tokenizer.apply_chat_template([{"role": "user", "content": q.text}])
               for q in load_prompts(str(head / "dev_prompts.jsonl"))[:n]]
    m = gen.manifest
    result = {"what": "greedy tau (tokens per verify cycle) by tree size; index = total_tokens",
              "artifact": f"{m['model']['source']}, {m['precision']} base, {m.get('draft_precision')} draft, "
                          f"draft vocabulary {(m.get('draft_vocab') or {}).get('size', 'full')}",
              "head": m["head"]["source"], "prompts": f"{n} of {head.name}/dev_prompts.jsonl",
              "max_new_tokens": max_new, "tau": {}}
    for depth, top_k in SHAPES:
        total = min(MAX_TOTAL, top_k + depth * top_k * top_k + 1)
        r = acceptance(gen, prompts, depth, top_k, max_new, total)
        result["tau"][f"{depth}/{top_k}"] = [round(t, 4) for t in r["tau"]]
        print(f"depth {depth}, top_k {top_k}: tau at {total} tokens {r['tau'][-1]:.2f}", file=sys.stderr)
    return result


def project(tau: dict, verify_ms: dict, draft_ms: dict, host_ms: float, plain_ms: float) -> list[dict]:
    """The best tree size of each shape. tau: {"depth/top_k": [tau at 0, 1, ... tokens]}; verify_ms by
    tree size (a size between two measured ones costs the next larger: CUDA graphs pad it to that
    bucket); draft_ms by depth (measured at one top_k, used for every shape); host_ms per cycle;
    plain_ms per token of plain decoding."""
    sizes = sorted(verify_ms)
    rows = []
    for shape, taus in tau.items():
        depth, top_k = map(int, shape.split("/"))
        if depth not in draft_ms:
            continue
        best = None
        for total in range(2, len(taus)):
            size = next((s for s in sizes if s >= total), None)
            if size is None:
                break
            cycle = verify_ms[size] + draft_ms[depth] + host_ms
            row = {"tree": f"{total}/{depth}/{top_k}", "tau": taus[total], "cycle_ms": cycle,
                   "tokens_per_s": 1e3 * taus[total] / cycle, "speedup": taus[total] * plain_ms / cycle}
            if best is None or row["speedup"] > best["speedup"]:
                best = row
        if best is not None:
            rows.append(best)
    return rows


# EAGLE-2 paper (arXiv 2406.16858), Table 1: LLaMA2-Chat 7B, MT-bench, temperature 0, tree of 60
# tokens, 6 draft levels (depth 5 here), top-k 10 (its Appendix A): speedup 3.43x on an A100.
PUBLISHED = {"model": "LLaMA2-Chat 7B", "head": "yuhuili/EAGLE-llama2-chat-7B", "prompts": "MT-bench",
             "tree": "60/5/10", "tau": 4.70, "source": "EAGLE-2 paper (arXiv 2406.16858), Table 1 and Appendix A"}


def rank_probabilities(q1: float, beta: float, top_k: int):
    import numpy as np
    return q1 * beta ** np.arange(top_k)


def max_q1(beta: float, top_k: int) -> float:
    """The largest q1 whose top_k rank probabilities sum to at most 1."""
    return (1 - beta) / (1 - beta ** top_k)


def modelled_tau(q1: float, beta: float, depth: int, top_k: int, max_total: int):
    """tau by tree size (index = total tokens, root included) of EAGLE-2's tree (depth, top_k)
    for a draft whose rank-r candidate is the base's token with probability q1 * beta^(r-1): the
    expected accepted tokens are 1 + the sum over drafted nodes of the product of their path's
    probabilities, and EAGLE-2 keeps the nodes of highest such value (eagle2/tree.py builds the
    same pool from the draft's own scores)."""
    import numpy as np
    q = rank_probabilities(q1, beta, top_k)
    if q.sum() > 1 + 1e-9:
        raise ValueError(f"rank probabilities q1={q1}, beta={beta} over top_k={top_k} sum to more than 1")
    layer = q.copy()
    pool = [layer]
    for _ in range(depth):
        frontier = np.sort(layer)[::-1][:top_k]
        layer = (frontier[:, None] * q[None, :]).ravel()
        pool.append(layer)
    values = np.sort(np.concatenate(pool))[::-1][:max_total - 1]
    return [0.0, 1.0] + list(1.0 + np.cumsum(values))


def fit_rank_model(tau: dict) -> dict:
    """(q1, beta) that best reproduce measured tau curves {"depth/top_k": [tau by size]}, by grid
    search on the squared error; with the largest relative error of the fit."""
    import numpy as np
    measured = {tuple(map(int, k.split("/"))): np.asarray(v) for k, v in tau.items()}
    widest = max(k for _, k in measured)
    best = None
    for q1 in np.arange(0.20, 0.95, 0.005):
        for beta in np.arange(0.05, 0.95, 0.01):
            if q1 > max_q1(beta, widest):
                continue
            err, worst = 0.0, 0.0
            for (d, k), m in measured.items():
                model = np.asarray(modelled_tau(q1, beta, d, k, len(m) - 1)[1:len(m)])
                err += float(((model - m[1:]) ** 2).sum())
                worst = max(worst, float((np.abs(model - m[1:]) / m[1:]).max()))
            if best is None or err < best["squared_error"]:
                best = {"q1": round(float(q1), 3), "beta": round(float(beta), 2), "squared_error": err,
                        "max_relative_error": worst}
    return best


def anchored_q1(beta: float, tree: str, target: float) -> float:
    """q1 at which the modelled tau of `tree` (total/depth/top_k) is `target` (bisection)."""
    total, depth, top_k = map(int, tree.split("/"))
    lo, hi = 0.0, max_q1(beta, top_k)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if modelled_tau(mid, beta, depth, top_k, total)[total] < target else (lo, mid)
    return (lo + hi) / 2


def interpolated(costs: dict, n: int) -> float | None:
    """Milliseconds of a verify step of n rows, linear between measured sizes (a CPU's cost grows
    with the rows; no CUDA-graph buckets here)."""
    sizes = sorted(int(s) for s in costs)
    if n > sizes[-1]:
        return None
    upper = next(s for s in sizes if s >= n)
    lower = max((s for s in sizes if s <= n), default=upper)
    if upper == lower:
        return costs[str(upper)]
    w = (n - lower) / (upper - lower)
    return (1 - w) * costs[str(lower)] + w * costs[str(upper)]


def large_model_projection(costs: list[dict], tau: dict) -> dict:
    """For each costs run (one top_k each) and each draft depth it measured: the modelled tau
    anchored to PUBLISHED, and the projected tokens/s of every tree size up to the largest verify
    step measured, with that run's own verify, draft and plain costs; the best size of each shape,
    and the published tree itself."""
    fit = fit_rank_model(tau)
    q1 = anchored_q1(fit["beta"], PUBLISHED["tree"], PUBLISHED["tau"])
    rows = []
    for run in costs:
        top_k, plain = run["draft_top_k"], run["plain_ms_per_token"]
        max_rows = max(int(s) for s in run["verify_ms"])
        for depth, draft in run["draft_ms_by_depth"].items():
            depth = int(depth)
            taus = modelled_tau(q1, fit["beta"], depth, top_k, max_rows)
            for total in range(2, min(max_rows, top_k + depth * top_k * top_k + 1) + 1):
                cycle = interpolated(run["verify_ms"], total) + draft
                rows.append({"tree": f"{total}/{depth}/{top_k}", "tau": taus[total], "cycle_ms": cycle,
                             "plain_ms": plain, "tokens_per_s": 1e3 * taus[total] / cycle,
                             "speedup": taus[total] * plain / cycle})
    best = {}
    for r in rows:
        shape = r["tree"].split("/", 1)[1]
        if shape not in best or r["speedup"] > best[shape]["speedup"]:
            best[shape] = r
    return {"what": "a PROJECTION: step costs measured on a random-weight checkpoint, acceptance from a "
                    "published figure and a model of the draft; nothing decoded with a trained head",
            "published": PUBLISHED, "rank_model": {**fit, "q1_anchored": round(q1, 4),
                                                   "fitted_on": "the shipped SmolLM2-135M head's tau curves"},
            "costs": costs, "best_by_shape": list(best.values()),
            "published_tree": next((r for r in rows if r["tree"] == PUBLISHED["tree"]), None)}


def projection_report(p: dict) -> str:
    m = p["rank_model"]
    runs = "; ".join(f"top_k {c['draft_top_k']}: plain decoding {c['plain_ms_per_token']:.0f} ms a token, a 4-row "
                     f"verify step {c['verify_vs_one_row']['4']:.2f}x a one-row step" for c in p["costs"])
    c = p["costs"][0]
    lines = [f"**Projection, not a measurement.** Step costs measured on {c['machine']} ({c['date']}, context "
             f"{c['context']}; {runs}). Acceptance: {p['published']['source']}: {p['published']['model']} with "
             f"{p['published']['head']} on {p['published']['prompts']}, tau {p['published']['tau']} at tree "
             f"{p['published']['tree']}. Other trees' tau: the rank model (beta {m['beta']} fitted on "
             f"{m['fitted_on']}, its largest relative error there {100 * m['max_relative_error']:.1f}%; q1 "
             f"{m['q1_anchored']:.3f} anchored to the published tau).", "",
             "| tree (total/depth/top_k) | modelled tau | draft + verify ms a cycle | projected tok/s | vs plain |",
             "|---|---|---|---|---|"]
    shown = sorted(p["best_by_shape"], key=lambda r: (int(r["tree"].split("/")[2]), int(r["tree"].split("/")[1])))
    if p["published_tree"]:
        shown.append({**p["published_tree"], "tree": p["published_tree"]["tree"] + " (the paper's tree)"})
    for r in shown:
        lines.append(f"| {r['tree']} | {r['tau']:.2f} | {r['cycle_ms']:.0f} | {r['tokens_per_s']:.2f} | "
                     f"{r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.projection")
    p.add_argument("artifact", nargs="?", help="SmolLM2-135M with its shipped head (python -m export smollm2-135m): "
                   "re-measure its tau")
    p.add_argument("--out", help="default: the shipped head's tau_greedy.json")
    p.add_argument("--costs", help="large models: costs from `runtime tune --costs-only --draft-depths ... --json` "
                   "(comma-separated files, one top_k each); projects EAGLE-2's speedup from the published tau")
    p.add_argument("--report", help="with --costs: write a Markdown table here")
    p.add_argument("--json", help="with --costs: write the projection here")
    a = p.parse_args(argv)
    if a.costs:
        result = large_model_projection([json.loads(Path(f).read_text()) for f in a.costs.split(",")],
                                        json.loads(tau_file().read_text())["tau"])
        text = projection_report(result)
        print(text)
        if a.report:
            Path(a.report).write_text(text)
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if not a.artifact:
        p.error("give an artifact to measure tau on, or --costs to project a large model")
    out = Path(a.out) if a.out else tau_file()
    out.write_text(json.dumps(measure_tau(a.artifact), indent=1) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
