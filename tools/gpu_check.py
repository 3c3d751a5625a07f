"""The torch backend on a device, checked and measured in one run (ci/gpu_check.sh on a GPU machine).

    python -m tools.gpu_check [--device cuda|cpu] [--quick] [--out DIR] [--precision fp16] [--tau FILE]

Exports --target torch artifacts into a temporary directory: tiny-llama, tiny-qwen2, the 24-token
tiny Llama of the sampling tests and, without --quick, random models of SmolLM2-135M's and
Llama-3.2-1B's shapes (their random heads accept next to nothing: they are there for the costs).
Then on the device, for each model, with CUDA graphs and without (CUDA only):
  greedy    EAGLE-2 greedy output against plain greedy decoding, two prompts, two trees (TREES):
            identical, or identical up to a first difference at which plain decoding's two candidate
            tokens are within rounding (TIE) of each other (a verify step batches the tree's rows,
            which reduced precision rounds differently from single steps; see verify_exact);
  sampling  (24-token model) the first three tokens of speculative sampling against the artifact's own
            plain distribution, chi-square p-value;
  costs     verify ms by tree size T = 1..64, draft ms per cycle by depth 1..6 (top_k 10), plain and
            EAGLE-2 tokens/s and host ms per cycle: what a tree tuner for the device needs.
Prints one table, writes it to DIR (or $GPU_CHECK_OUT) as gpu_check.md and gpu_check.json, with a
projection (tools/projection.py) of SmolLM2-135M's speedup there; exits 1 when a check failed.
onnxruntime-gpu's provider="cuda" (fp16, exact attention, caches and step outputs on the GPU) is
checked and measured on tiny-llama where CUDAExecutionProvider exists.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = (1, 2, 4, 8, 16, 32, 64)
DEPTHS = (1, 2, 3, 4, 5, 6)
DRAFT_TOP_K = 10
# (total_tokens, depth, top_k) of the greedy checks; the last one is also timed. The tiny models'
# random heads grow their features about 4x per level, past fp16's range beyond depth 4: they get
# trees of depth 3.
TREES = ((8, 3, 3), (60, 5, 10))
TINY_TREES = ((8, 3, 3), (32, 3, 10))
# The tiny random head's own features overflow fp16 in ONNX Runtime's attention past depth 2 (torch's
# attention computes its softmax in fp32).
ORT_TREES = ((8, 2, 3), (32, 2, 10))
PROMPTS = ("The quick brown fox jumps over", "Once upon a time, in a land far away, there lived")
# A divergence counts as a near-tie when plain decoding's two candidates differ by less than this
# fraction of the largest |logit| at that point: a few units of the precision's rounding.
TIE = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2}
ALPHA = 1e-3
SAMPLING_VOCAB, SAMPLING_PROMPT = 24, [3, 17, 5, 9]
SHAPES = {  # random models of real shapes (no rope scaling: it does not change the costs)
    "smollm2-135m-shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                               num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5),
    "llama-1b-shape": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                           num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=5e5),
}


def shaped_checkpoint(name: str, seed: int = 0):
    """A random Llama of a real shape with a random EAGLE head: weights N(0, 0.02) like a fresh
    Hugging Face model (the tiny models' larger weights would overflow fp16 at this width), norms 1."""
    import torch

    from models.config import ModelConfig
    from models.llama import CausalLM, EagleHead
    from models.tiny import byte_tokenizer
    from models.weights import Checkpoint
    cfg = ModelConfig(model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=True,
                      **SHAPES[name])
    head_cfg = dataclasses.replace(cfg, num_layers=1)
    g = torch.Generator().manual_seed(seed)

    def random_state(module_type, c):
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in module_type(c).state_dict().items() if k != "lm_head.weight"}
        return {k: torch.ones(s) if "norm" in k else 0.02 * torch.randn(s, generator=g) for k, s in shapes.items()}

    return Checkpoint(cfg=cfg, state=random_state(CausalLM, cfg), tokenizer=byte_tokenizer(), source=f"random {name}",
                      head_cfg=head_cfg, head_state=random_state(EagleHead, head_cfg), head_source="random")


def sampling_checkpoint():
    """The 24-token tiny Llama of tests/test_runtime_sampling.py: exact 3-token distributions are cheap."""
    from models.tiny import tiny_checkpoint
    ckpt = tiny_checkpoint("llama", seed=3)
    cfg = dataclasses.replace(ckpt.cfg, vocab_size=SAMPLING_VOCAB, eos_token_ids=())
    for state in (ckpt.state, ckpt.head_state):
        for name in [n for n in state if n.endswith(("embed_tokens.weight", "lm_head.weight"))]:
            state[name] = state[name][:SAMPLING_VOCAB].clone() * 2.5  # sharper than the random init
    ckpt.cfg, ckpt.head_cfg = cfg, cfg
    return ckpt


def last_logits(gen, tokens: list[int]) -> np.ndarray:
    """Plain decoding's logits after `tokens`."""
    e = gen.engine
    e.start(len(tokens))
    for start in range(0, len(tokens), 128):
        row = e.prefill(np.asarray(tokens[start:start + 128], np.int64), start)
    return np.asarray(row, np.float64)


def greedy_check(gen, prompts: list[list[int]], trees, max_new: int, tie: float) -> dict:
    worst = {"ok": True, "status": "identical"}
    for ids in prompts:
        plain = gen.generate(ids, max_new_tokens=max_new, speculative=False).token_ids
        for total, depth, top_k in trees:
            spec = gen.generate(ids, max_new_tokens=max_new, total_tokens=total, depth=depth, top_k=top_k).token_ids
            if spec == plain:
                continue
            i = next(j for j, (a, b) in enumerate(zip(plain, spec)) if a != b)
            row = last_logits(gen, ids + plain[:i])
            margin = (row[plain[i]] - row[spec[i]]) / np.abs(row).max()
            ok = bool(abs(margin) <= tie)
            status = f"{'near-tie' if ok else 'FAIL'} at token {i} of {len(plain)} (margin {margin:.1e})"
            if worst["ok"]:
                worst = {"ok": ok, "status": status}
    return worst


def sampling_pvalue(gen, draws: int) -> float:
    from scipy import stats

    from eagle2 import process_logits
    v, prompt = SAMPLING_VOCAB, SAMPLING_PROMPT
    probs = lambda extra: process_logits(last_logits(gen, prompt + extra), 1.0)
    exact = probs([])[:, None, None] * np.stack([probs([a]) for a in range(v)])[:, :, None] * \
        np.stack([[probs([a, b]) for b in range(v)] for a in range(v)])
    counts = np.zeros((v,) * 3)
    for seed in range(draws):
        out = gen.generate(prompt, max_new_tokens=3, temperature=1.0, seed=seed, total_tokens=8, depth=3, top_k=3)
        counts[tuple(out.token_ids)] += 1
    if counts[exact == 0].sum() > 0:
        return 0.0
    expected, observed = exact.ravel() * draws, counts.ravel()
    big = expected >= 5  # outcomes expected fewer than 5 times are pooled into one bin
    obs, exp = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    return float(stats.chisquare(obs[exp > 0], exp[exp > 0]).pvalue)


def draft_costs(gen, context: int, reps: int) -> dict[int, float]:
    """Draft ms per cycle by depth, top_k DRAFT_TOP_K: the head on one new token, then `depth` levels of
    k nodes (k chains here: the cost depends on the shapes only, and no tree bookkeeping rejects the
    NaN that a random head's features reach in fp16 after a few levels)."""
    e, k = gen.engine, DRAFT_TOP_K
    tokens = np.arange(10, 10 + k, dtype=np.int64) % gen.vocab_size
    costs = {}
    for depth in DEPTHS:
        times = []
        for _ in range(reps):
            before = e.timings["draft"]
            hidden, _, _ = e.draft_context(np.array([11], np.int64), context - 1, k)
            hidden = hidden[np.zeros(k, np.int64)]
            for step in range(depth):
                chains = np.tile(np.eye(k, dtype=bool), (1, step + 1))  # node i sees column i of every level
                hidden, _, _ = e.draft_expand(tokens, hidden, chains, context, step, k)
            times.append(e.timings["draft"] - before)
        costs[depth] = 1e3 * float(np.median(times))
    return costs


def measure(gen, precision: str, quick: bool, trees=TREES, sampling: bool = False) -> dict:
    """The checks, and (but for the sampling model, whose 24 tokens the cost runs' ids exceed) the costs."""
    from runtime.tune import verify_costs
    gen.stop_ids.clear()  # exactly max_new tokens everywhere
    prompts = [[t % gen.vocab_size for t in gen.tokenizer.encode(p)] for p in PROMPTS]
    max_new = 32 if quick else 64
    row = {"greedy": greedy_check(gen, prompts, trees, max_new, TIE[precision])}
    errors = [s.steps.graph_error for s in (gen.engine.base, gen.engine.draft) if getattr(s, "steps", None)]
    if any(errors):
        row["graphs"] = {"ok": False, "status": f"CUDA graph capture failed, ran eagerly: {next(filter(None, errors))}"}
    if sampling:
        p = sampling_pvalue(gen, 400 if quick else 2000)
        row["sampling"] = {"ok": p > ALPHA, "pvalue": p}
        return row
    plain = gen.generate(prompts[0], max_new_tokens=2 * max_new, speculative=False)
    total, depth, top_k = trees[-1]
    spec = gen.generate(prompts[0], max_new_tokens=2 * max_new, total_tokens=total, depth=depth, top_k=top_k)
    row["plain_tok_s"], row["eagle_tok_s"] = plain.timings["tokens_per_s"], spec.timings["tokens_per_s"]
    row["tree"], row["tau"] = f"{total}/{depth}/{top_k}", spec.mean_accept_length
    # Last: draft_costs leaves a random head's non-finite features in the draft cache.
    context = min(100 if quick else 512, gen.max_length - 2 * max(SIZES))
    reps = 5 if quick else 15
    row["verify_ms"] = {n: 1e3 * s for n, s in verify_costs(gen, list(SIZES), context, reps).items()}
    row["draft_ms"] = draft_costs(gen, context, reps)
    row["host_ms"] = 1e3 * spec.timings["host"] / len(spec.accept_lengths)
    return row


def load(path: Path, device: str, graphs: bool | None):
    import runtime
    return runtime.load(path, provider="torch", device=device,
                        provider_options=None if graphs is None else {"cuda_graphs": graphs})


def ort_cuda(root: Path, quick: bool) -> dict:
    """provider="cuda" of onnxruntime-gpu, where it is installed: tiny-llama exported as a CUDA user
    exports it (fp16, exact attention), caches and step outputs on the GPU; the same greedy check and
    costs as the torch rows."""
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return {"skipped": f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers: "
                           f"{', '.join(ort.get_available_providers())}); install onnxruntime-gpu to check it"}
    import runtime
    from export.onnx_export import export_onnx
    from models.registry import load_checkpoint
    path = root / "tiny-llama-onnx-fp16"
    export_onnx(load_checkpoint("tiny-llama"), path, "fp16", 256, verify=False, log=lambda m: None)
    row = {"model": "tiny-llama (onnx)", "mode": "onnxruntime cuda"}
    try:
        return {**row, **measure(runtime.load(path, provider="cuda"), "fp16", quick, ORT_TREES)}
    except Exception as e:
        return {**row, "greedy": {"ok": False, "status": f"error: {type(e).__name__}: {e}"}}


def run(device: str, quick: bool, precision: str, root: Path) -> list[dict]:
    import torch

    from export.torch_export import export_torch
    from models.registry import load_checkpoint
    models = {"tiny-llama": lambda: load_checkpoint("tiny-llama"), "tiny-qwen2": lambda: load_checkpoint("tiny-qwen2"),
              "tiny-llama-v24": sampling_checkpoint}
    if not quick:
        models.update({name: (lambda n=name: shaped_checkpoint(n)) for name in SHAPES})
    is_cuda = torch.device(device).type == "cuda"
    modes = (True, False) if is_cuda else (None,)
    rows = []
    for name, make in models.items():
        start = time.perf_counter()
        tiny = name.startswith("tiny")
        try:
            ckpt = make()
            params = sum(v.numel() for v in ckpt.state.values()) / 1e6
            export_torch(ckpt, root / name, "torch", precision, max_length=256 if tiny else 2048, verify=tiny,
                         log=lambda m: None)
            del ckpt
        except Exception as e:
            rows.append({"model": name, "mode": "export", "greedy": {"ok": False, "status": f"export error: {e}"}})
            continue
        print(f"{name}: exported in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        for graphs in modes:
            gen = load(root / name, device, graphs)
            mode = {True: "cuda graphs", False: "eager", None: device}[graphs]
            try:
                checks = measure(gen, precision, quick, TINY_TREES if tiny else TREES,
                                 sampling=name == "tiny-llama-v24")
            except Exception as e:  # one model's failure must not cost the others' rows
                checks = {"greedy": {"ok": False, "status": f"error: {type(e).__name__}: {e}"}}
            rows.append({"model": name, "params_m": round(params, 1), "mode": mode, **checks})
            print(f"{name} ({mode}): {rows[-1]['greedy']['status']}", file=sys.stderr)
            del gen
            if is_cuda:
                torch.cuda.empty_cache()
    return rows


def failures(rows: list[dict]) -> list[str]:
    return [f"{r['model']} ({r['mode']}) {check}: {r[check].get('status', r[check])}"
            for r in rows for check in ("greedy", "sampling", "graphs") if check in r and not r[check]["ok"]]


def table(rows: list[dict]) -> str:
    head = (["model", "M params", "mode", "greedy vs plain", "sampling p", "plain tok/s", "EAGLE-2 tok/s (tree, τ)",
             "host ms/cycle"] + [f"verify T={n}" for n in SIZES] + [f"draft d={d}" for d in DEPTHS])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        greedy = r["greedy"]["status"] + (f"; {r['graphs']['status']}" if "graphs" in r else "")
        cells = [r["model"], str(r.get("params_m", "")), r["mode"], greedy,
                 f"{r['sampling']['pvalue']:.3f}" if "sampling" in r else ""]
        if "verify_ms" in r:
            cells += [f"{r['plain_tok_s']:.1f}", f"{r['eagle_tok_s']:.1f} ({r['tree']}, {r['tau']:.2f})",
                      f"{r['host_ms']:.2f}"]
            cells += [f"{r['verify_ms'][n]:.2f}" for n in SIZES] + [f"{r['draft_ms'][d]:.2f}" for d in DEPTHS]
        else:
            cells += [""] * (len(head) - len(cells))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def projection(rows: list[dict], tau_file: Path) -> dict | None:
    """SmolLM2-135M's projected speedup: its head's tau (CPU) on the costs of its shape here (the
    tiny-llama costs in a --quick run, which only exercises the arithmetic)."""
    from .projection import project
    measured = [r for r in rows if "verify_ms" in r]
    costs = next((r for r in measured if r["model"] == "smollm2-135m-shape"), measured[0] if measured else None)
    if costs is None or not tau_file.is_file():
        return None
    tau = json.loads(tau_file.read_text())
    return {"costs_of": f"{costs['model']} ({costs['mode']})", "tau_from": tau["artifact"],
            "rows": project(tau["tau"], costs["verify_ms"], costs["draft_ms"], costs["host_ms"],
                            1e3 / costs["plain_tok_s"])}


def report(result: dict) -> str:
    lines = [f"# GPU check: torch backend on {result['device_name']} ({result['precision']}, torch {result['torch']})",
             "", table(result["rows"]), "",
             "verify: ms per base step by tree size T; draft: ms of draft calls per cycle by depth (top_k "
             f"{DRAFT_TOP_K}); host: ms per EAGLE-2 cycle outside the graphs.", ""]
    ort = result["onnxruntime_cuda"]
    lines.append(f"onnxruntime-gpu (provider=\"cuda\"): {ort['skipped']}" if "skipped" in ort else table([ort]))
    p = result["projection"]
    if p:
        lines += ["", f"PROJECTION, not a measurement: SmolLM2-135M's greedy τ measured on the CPU ({p['tau_from']}) "
                  f"with the costs measured here for {p['costs_of']}; best tree size per shape.", "",
                  "| tree | τ | cycle ms | projected tok/s | projected speedup |", "|---|---|---|---|---|"]
        lines += [f"| {r['tree']} | {r['tau']:.2f} | {r['cycle_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                  f"{r['speedup']:.2f}x |" for r in p["rows"]]
    failed = result["failures"]
    lines += ["", "FAILED: " + "; ".join(failed) if failed else "all checks passed"]
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch

    from .projection import tau_file
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny models only, fewer samples and repetitions")
    p.add_argument("--precision", default="fp16", choices=sorted(TIE))
    p.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT"), help="write gpu_check.md and .json here")
    p.add_argument("--tau", default=str(tau_file()), help="tau per tree for the projection (tools/projection.py)")
    a = p.parse_args(argv)
    start = time.perf_counter()
    is_cuda = torch.device(a.device).type == "cuda"
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        rows = run(a.device, a.quick, a.precision, Path(tmp))
        ort = ort_cuda(Path(tmp), a.quick) if is_cuda else {"skipped": f"device {a.device} is not CUDA"}
    result = {"device": a.device, "device_name": torch.cuda.get_device_name(a.device) if is_cuda else "CPU",
              "precision": a.precision, "torch": torch.__version__, "quick": a.quick, "rows": rows,
              "onnxruntime_cuda": ort, "projection": projection(rows, Path(a.tau)),
              "failures": failures(rows + ([ort] if "skipped" not in ort else []))}
    result["seconds"] = round(time.perf_counter() - start, 1)
    text = report(result)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(text + "\n")
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
