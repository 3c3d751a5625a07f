"""Tau of a training run's head snapshots (python -m training.train_head --snapshots N) by prompt
category, against the tokens each had trained on: a Markdown table, the sums as JSON and a plot.

    python -m tools.tau_curve RUN_DIR --base smollm2-135m [--precision w8a8] [--prompts mtbench:5,gsm8k:10]
        [--trees 4/1/2+8,60/5/10] [--max-new-tokens 128] [--report tau.md] [--json tau.json] [--plot tau.png]

Each snapshot is exported with the base as a user exports it (python -m export BASE --head
SNAPSHOT, parity check included) into a temporary directory, measured (tools.acceptance.measure:
greedy, the base's own replies) and deleted, so the disk holds one artifact at a time. Tau does
not depend on the machine's load, so this may run next to other work.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from .acceptance import category_tau, measure, publish


def snapshots(run: Path) -> list[tuple[Path, dict]]:
    """(directory, its snapshot.json) of every snapshot of a run, in training order."""
    found = sorted((run / "snapshots").glob("step-*"))
    if not found:
        raise SystemExit(f"{run} has no snapshots: train with --snapshots N")
    return [(d, json.loads((d / "snapshot.json").read_text())) for d in found]


def markdown(points: list[dict], header: str) -> str:
    categories = list(dict.fromkeys(c for p in points for tree in p["tau"].values() for c in tree))
    lines = [header, "", "| step | trained tokens | epochs | tree | " + " | ".join(categories) + " |",
             "|---:|---:|---:|---|" + "---:|" * len(categories)]
    for p in points:
        for tree, tau in p["tau"].items():
            cells = [f"{tau[c]:.2f}" if c in tau else "" for c in categories]
            lines.append(f"| {p['step']} | {p['trained_tokens']:,} | {p['epochs']} | {tree} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trees = list(points[0]["tau"])
    fig, axes = plt.subplots(1, len(trees), figsize=(6 * len(trees), 4.2), squeeze=False)
    for ax, tree in zip(axes[0], trees):
        x = [p["trained_tokens"] / 1e6 for p in points]
        for c in points[0]["tau"][tree]:
            y = [p["tau"][tree].get(c) for p in points]
            ax.plot(x, y, "o-" if c == "all" else ".-", lw=2.5 if c == "all" else 1, label=c)
        ax.set_xlabel("tokens trained on (millions)")
        ax.set_ylabel("tau (tokens per verify cycle)")
        ax.set_title(f"tree {tree}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1, 0.5))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.tau_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="the --out directory of a training run with --snapshots")
    p.add_argument("--base", required=True, help="the base the head was trained for (alias or directory)")
    p.add_argument("--precision", help="the export's precision (default: this CPU's)")
    p.add_argument("--prompts", default="mtbench:5,gsm8k:10", help="comma-separated prompt sets (tools.acceptance)")
    p.add_argument("--trees", default="tuned", help="'tuned' and/or total_tokens/depth/top_k[+lookup] items")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--report", help="write the Markdown table here")
    p.add_argument("--json", help="write the points here")
    p.add_argument("--plot", help="write the plot (PNG) here")
    a = p.parse_args(argv)
    from export.cli import main as export
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    points = []
    for directory, info in snapshots(a.run):
        tmp = Path(tempfile.mkdtemp(prefix="tau-curve-"))
        try:
            artifact = tmp / "artifact"
            options = ["--precision", a.precision] if a.precision else []
            if export([a.base, "--head", str(directory), "--out", str(artifact), *options]) != 0:
                raise SystemExit(f"exporting {directory} failed")
            sums = measure(str(artifact), "cpu", a.prompts.split(","), a.trees, a.max_new_tokens)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        points.append({**info, "snapshot": directory.name, "sums": sums,
                       "tau": {tree: category_tau(s) for tree, s in sums.items()}})
        print(f"{directory.name}: " + ", ".join(f"{t} {v['all']:.2f}" for t, v in points[-1]["tau"].items()),
              file=sys.stderr)
    header = (f"tau of {a.run.name}'s snapshots by category ({a.prompts}, first turns, up to {a.max_new_tokens} "
              f"new tokens, greedy); python -m tools.tau_curve {argv_text}")
    publish(markdown(points, header), {"header": header, "points": points}, a.report, a.json)
    if a.plot:
        plot(points, a.plot, f"tau of {a.run.name}'s snapshots ({a.prompts}, first turns, up to {a.max_new_tokens} "
             "new tokens, greedy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
