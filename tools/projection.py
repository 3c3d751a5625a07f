"""Projected EAGLE-2 speedup on a device, from tau measured elsewhere and step costs measured there.

Greedy tau belongs to the model, the head and the prompts, not to the device: verification keeps
plain decoding's output, and which drafted tokens match it does not depend on how fast either runs
(up to near-ties that another precision may break differently). So tau measured on the CPU with the
real SmolLM2-135M head (tau_file()), with the verify and draft costs measured on a GPU for a random
model of SmolLM2's shape (tools/gpu_check.py), projects tokens/s = tau / (verify + draft + host)
per cycle. A projection, and labelled so wherever it is shown: nothing decodes with the real head on
the GPU.

    python -m runtime.projection ARTIFACT [--out FILE]   # re-measure tau (a SmolLM2-135M artifact, CPU)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.projection")
    p.add_argument("artifact", help="SmolLM2-135M with its shipped head (python -m export smollm2-135m)")
    p.add_argument("--out", help="default: the shipped head's tau_greedy.json")
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else tau_file()
    out.write_text(json.dumps(measure_tau(a.artifact), indent=1) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
