"""Side-by-side benchmark: plain decoding and EAGLE-2 trees of one or more artifacts, and the plain
decoders users would run instead (onnxruntime-genai, llama.cpp, OpenVINO GenAI), in one run.

    python -m runtime.bench ARTIFACT[@PROVIDER[:HINT]] [...] [--provider cpu] [--prompts mtbench:2]
                            [--max-new-tokens 128] [--trees tuned,4/2/2,4/1/2+4,...] [--peers genai,llamacpp,openvino-genai]
                            [--reference FP32_ARTIFACT] [--worker ipex=.venv-ipex/bin/python]
                            [--report bench.md] [--json bench.json] [--plot bench.png]

Each prompt is decoded by every configuration back to back, so machine drift hits all alike. Every
configuration decodes exactly --max-new-tokens tokens (stop tokens ignored), greedily, from the same
token ids. Tokens/s counts decode time after the first token. For each artifact, every tree's
output is checked token-identical to its plain decoding. Bandwidth = weight bytes read per token
(base, plus the draft's calls, per accepted token) x tokens/s: read every figure against the
machine's memory bandwidth. Artifacts whose provider needs another Python environment (IPEX,
OpenVINO) run in a worker process under that environment's interpreter (--worker; see
runtime/bench_worker.py), interleaved with the rest all the same.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
from tqdm import tqdm

from artifact.manifest import read_manifest
from models.cpu import cpu_name

from .api import load
from . import long_context
from .generation import TREE_FIELDS, as_tree, tree_label
from .peers import make_peers
from .prompts import load_prompts
from .providers import target_provider
from .session import openvino_options
from .tokenizer import ChatTokenizer


@dataclass
class Config:
    label: str
    run: object                     # ids -> (token ids, seconds after the first token, output or None)
    group: str                      # artifact label or "peers"
    tree: tuple | None = None
    weight_bytes: int = 0
    draft_bytes: int = 0
    exact: bool = True              # speculative output must equal plain output token for token
    totals: dict = field(default_factory=lambda: {"tokens": 0, "seconds": 0.0, "cycles": 0, "accepted": 0,
                                                  "draft": 0.0, "verify": 0.0, "host": 0.0,
                                                  "same_tokens": 0, "compared": 0})


# Per-cycle timings of speculative decoding that the report splits a cycle into.
CYCLE_TIMINGS = ("draft", "verify", "host")

# (op, input index) of ONNX nodes that read only a few rows of a table per token: an embedding's
# Gather and RotaryEmbedding's cos/sin tables.
ROW_LOOKUPS = {("Gather", 0), ("RotaryEmbedding", 2), ("RotaryEmbedding", 3)}


def graph_weight_bytes(artifact: Path, spec: dict) -> int:
    """Bytes of the weights a graph reads in a step: an ONNX graph's external initializers, or the file
    of a TorchScript graph (its weights are inside), less the tables it only looks rows up in (an
    untied or int8 model's fp32 embedding is a fifth of its file and costs one row a token)."""
    path = artifact / spec["file"]
    if path.suffix != ".onnx":
        return path.stat().st_size - torchscript_lookup_bytes(path)
    model = onnx.load(str(path), load_external_data=False)
    uses: dict[str, set] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, set()).add((node.op_type, i))
    return sum(int({e.key: e.value for e in t.external_data}["length"]) for t in model.graph.initializer
               if t.data_location == onnx.TensorProto.EXTERNAL and not uses.get(t.name, set()) <= ROW_LOOKUPS)


def torchscript_lookup_bytes(path: Path) -> int:
    """Bytes of a frozen TorchScript graph's tensor constants that it only looks rows up in (an
    embedding table not shared with the lm_head: IPEX int8 bases, every torch draft)."""
    import torch
    graph = torch.jit.load(str(path), map_location="cpu").graph
    uses: dict[str, set] = {}
    for node in graph.nodes():
        for i, value in enumerate(node.inputs()):
            uses.setdefault(value.debugName(), set()).add((node.kind(), i))
    tables = [node.t("value") for node in graph.nodes()
              if node.kind() == "prim::Constant" and node.output().type().kind() == "TensorType"
              and uses.get(node.output().debugName()) == {("aten::embedding", 0)}]
    return sum(t.numel() * t.element_size() for t in tables)


def parse_trees(spec: str, gen) -> list[tuple[int, int, int, int] | None]:
    """'tuned' (or the artifact's default tree) and total/depth/top_k[+lookup] items (no +: no lookup);
    'sized' (the default call's tree, sized by step costs) is artifact_configs' own."""
    trees = []
    for item in filter(None, spec.split(",")):
        if item == "sized":
            continue
        if item in ("tuned", "default"):
            d = gen.tree_defaults
            trees.append(tuple(d[f] for f in TREE_FIELDS) if gen.speculative_default else None)
        else:
            shape, _, lookup = item.partition("+")
            trees.append((*(int(v) for v in shape.split("/")), int(lookup or 0)))
    return list(dict.fromkeys(t for t in trees if t is not None))


def split_spec(spec: str, default_provider: str) -> tuple[str, str, str | None]:
    """ARTIFACT[@PROVIDER[:PRECISION_HINT]] -> (path, provider, OpenVINO precision hint)."""
    path, _, where = spec.partition("@")
    provider, _, hint = (where or default_provider).partition(":")
    if hint and provider != "openvino":
        raise SystemExit(f"{spec}: a precision hint (':{hint}') is an OpenVINO option")
    return path, provider, hint or None


def load_spec(spec: str, default_provider: str, reuse: bool = False):
    """(Generator, provider, hint): ONNX artifacts on their provider (ARTIFACT@openvino:bf16 picks the
    provider and OpenVINO's precision hint), torch ones on their own target. reuse: prompts' shared
    document is filled once (decode speed is measured after the first token either way)."""
    path, provider, hint = split_spec(spec, default_provider)
    manifest = read_manifest(Path(path), verify_checksums=False)
    provider = target_provider(manifest["target"], provider)
    options = openvino_options("CPU", hint) if provider == "openvino" else None
    # Otherwise every run starts cold, as the peers' do: a prompt measured twice must not reuse its first
    # run's caches.
    return load(path, provider=provider, provider_options=options, prefix_cache_mb=None if reuse else 0), provider, hint


def artifact_configs(spec: str, default_provider: str, trees_spec: str, n: int, reuse: bool = False) -> list[Config]:
    """Plain decoding and the trees of one artifact."""
    gen, provider, hint = load_spec(spec, default_provider, reuse)
    path = split_spec(spec, default_provider)[0]
    gen.stop_ids.clear()  # exactly n tokens for every configuration
    label = f"{Path(path).name} ({gen.manifest['precision']}, {provider}{':' + hint if hint else ''})"
    graphs = gen.manifest["graphs"]
    base_bytes = graph_weight_bytes(Path(path), graphs["base"])
    draft_bytes = graph_weight_bytes(Path(path), graphs["draft"]) if gen.engine.draft is not None else 0

    def runner(tree):
        def run(ids):
            kwargs = {"speculative": False} if tree is None else {} if tree == "sized" else as_tree(tree)
            out = gen.generate(ids, max_new_tokens=n, **kwargs)
            return out.token_ids, out.timings["total"] - out.timings["first_token"], out
        return run

    trees = parse_trees(trees_spec, gen) if gen.engine.draft is not None else []
    exact = gen.verify_exact
    configs = [Config(f"{label} plain", runner(None), label, None, base_bytes)] + \
        [Config(f"{label} EAGLE-2 {tree_label(as_tree(t))}", runner(t), label, t, base_bytes, draft_bytes, exact=exact)
         for t in trees]
    if "sized" in trees_spec.split(",") and gen.step_costs is not None:
        default = tuple(gen.tree_defaults[f] for f in TREE_FIELDS)
        configs.append(Config(f"{label} EAGLE-2 {tree_label(gen.tree_defaults)} sized", runner("sized"), label,
                              default, base_bytes, draft_bytes, exact=exact))
    return configs


def provider_of(spec: str, default_provider: str) -> str:
    path, provider, _ = split_spec(spec, default_provider)
    target = read_manifest(Path(path), verify_checksums=False)["target"]
    return target_provider(target, provider)


def worker_configs(spec: str, python: str, default_provider: str, trees_spec: str, n: int) -> list[Config]:
    """artifact_configs of `spec`, decoded by a runtime.bench_worker process under `python`."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        worker = subprocess.Popen([python, "-m", "runtime.bench_worker", spec, default_provider, trees_spec, str(n)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    except OSError as e:
        raise SystemExit(f"{spec}: cannot start its worker {python}: {e}") from e

    def receive():
        line = worker.stdout.readline()
        if not line:
            raise SystemExit(f"{spec}: its worker ({python} -m runtime.bench_worker) exited; its error is above")
        return json.loads(line)

    def runner(index: int):
        def run(ids):
            worker.stdin.write(json.dumps({"config": index, "ids": list(ids)}) + "\n")
            worker.stdin.flush()
            r = receive()
            out = None if r["accept_lengths"] is None else SimpleNamespace(accept_lengths=r["accept_lengths"],
                                                                           timings=r["timings"])
            return r["tokens"], r["seconds"], out
        return run

    return [Config(c["label"], runner(i), c["group"], tuple(c["tree"]) if c["tree"] else None, c["weight_bytes"],
                   c["draft_bytes"], c["exact"]) for i, c in enumerate(receive())]


def peer_configs(names: list[str], model: str, n: int, positions: int) -> list[Config]:
    configs = []
    for peer in make_peers(names, model, positions=positions):
        def run(ids, peer=peer):
            return None, peer.decode(ids, n), None
        configs.append(Config(f"{peer.name} {peer.mode}", run, "peers", None, peer.weight_bytes))
    return configs


def measure(configs: list[Config], prompts: list[list[int]], n: int) -> None:
    for ids in tqdm(prompts, desc="prompts", file=sys.stderr):
        reference = {}
        for c in configs:
            tokens, seconds, out = c.run(ids)
            if tokens is not None:
                if c.tree is None:
                    reference[c.group] = tokens
                elif tokens != reference[c.group] and c.exact:
                    raise AssertionError(f"{c.label}: output differs from plain decoding of the same artifact")
                same = np.cumprod(np.asarray(tokens) == np.asarray(reference[c.group]))
                c.totals["same_tokens"] += int(same.sum())
                c.totals["compared"] += len(tokens)
            t = c.totals
            t["tokens"] += n - 1
            t["seconds"] += seconds
            if out is not None and c.tree is not None:
                t["cycles"] += len(out.accept_lengths)
                t["accepted"] += sum(out.accept_lengths)
                for key in CYCLE_TIMINGS:
                    t[key] += out.timings[key]


def summarize(configs: list[Config]) -> list[dict]:
    rows = []
    speed_of = {c.label: c.totals["tokens"] / c.totals["seconds"] for c in configs}
    plain = {c.group: speed_of[c.label] for c in configs if c.tree is None and c.group != "peers"}
    best_peer = max((speed_of[c.label] for c in configs if c.group == "peers"), default=None)
    for c in configs:
        t = c.totals
        speed = speed_of[c.label]
        tau = t["accepted"] / t["cycles"] if t["cycles"] else 1.0
        cycles = max(t["cycles"], 1)
        draft_calls = (c.tree[1] + 1) if c.tree else 0  # context + depth expansions per cycle
        per_token = (c.weight_bytes + draft_calls * c.draft_bytes) / tau
        rows.append({"config": c.label, "tokens_per_s": speed,
                     "vs_plain": speed / plain[c.group] if c.group != "peers" else 1.0,
                     "vs_best_peer": speed / best_peer if best_peer else None, "tau": tau,
                     "draft_ms": 1e3 * t["draft"] / cycles if c.tree else 0.0,
                     "verify_ms": 1e3 * t["verify"] / cycles if c.tree else 0.0,
                     "host_ms": 1e3 * t["host"] / cycles if c.tree else 0.0,
                     "weight_mb_per_token": per_token / 1e6, "gb_per_s": per_token * speed / 1e9,
                     "tree": list(c.tree) if c.tree else None, "group": c.group,
                     # share of tokens before the first difference from plain decoding (1.0 when exact)
                     "same_as_plain": t["same_tokens"] / t["compared"] if t["compared"] else None})
    return rows


def agreement(path: str, reference: str, provider: str, prompts: list[list[int]], n: int) -> dict:
    """Teacher-forced top-1 agreement and perplexity of `path` against `reference` (e.g. fp32) on the
    reference's own greedy replies."""
    from eagle2 import tree_from_parents
    gens = [load_spec(p, provider)[0] for p in (reference, path)]
    agree, total, nll = 0, 0, np.zeros(2)
    for ids in prompts:
        text = ids + gens[0].generate(ids, max_new_tokens=n, speculative=False).token_ids
        rows = []
        for g in gens:
            e = g.engine
            e.start(len(text))
            for start in range(0, len(ids), 128):
                first = e.prefill(np.asarray(ids[start:start + 128], np.int64), start).copy()
            r = [first]
            for i in range(len(ids), len(text) - 1):
                r.append(e.verify(tree_from_parents([text[i]], [-1]), i)[0].copy())
                e.commit(np.array([0]), i)
            rows.append(np.stack(r))
        targets = np.asarray(text[len(ids):])
        agree += int((rows[0].argmax(-1) == rows[1].argmax(-1)).sum())
        total += len(targets)
        for k, lg in enumerate(rows):
            lg = lg - lg.max(-1, keepdims=True)
            nll[k] -= float((lg[np.arange(len(targets)), targets] - np.log(np.exp(lg).sum(-1))).sum())
    return {"top1_agreement": agree / total, "perplexity_reference": float(np.exp(nll[0] / total)),
            "perplexity": float(np.exp(nll[1] / total)), "tokens": total}


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| configuration | tok/s | vs plain | vs best peer | tau | draft ms/cycle | verify ms/cycle "
             "| host ms/cycle | weight MB/token | GB/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peer = f"{r['vs_best_peer']:.2f}x" if r["vs_best_peer"] else "-"
        cyc = (f"{r['draft_ms']:.1f} | {r['verify_ms']:.1f} | {r['host_ms']:.1f}") if r["tree"] else "- | - | -"
        lines.append(f"| {r['config']} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}x | {peer} | {r['tau']:.2f} | "
                     f"{cyc} | {r['weight_mb_per_token']:.0f} | {r['gb_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.4))
    groups = [g for g in dict.fromkeys(r["group"] for r in rows) if g != "peers"]
    for g in groups:
        pts = sorted(((r["tree"][0] if r["tree"] else 1), r["tokens_per_s"], r["config"]) for r in rows
                     if r["group"] == g)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{g}: plain (1) and EAGLE-2 trees")
        for x, y, name in pts:
            if x > 1:
                ax.annotate(name.rsplit(" ", 1)[-1], (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
    for r in rows:
        if r["group"] == "peers":
            ax.axhline(r["tokens_per_s"], ls="--", lw=1, color="gray")
            ax.annotate(r["config"].removesuffix(" plain"), (1, r["tokens_per_s"]), textcoords="offset points",
                        xytext=(2, 2), fontsize=7, color="dimgray")
    ax.set_xscale("log", base=2)
    ax.margins(x=0.08)  # room for the last labels
    ax.set_xlabel("draft-tree tokens per step (1 = plain decoding; +L: up to L lookup tokens more)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the lines stay readable
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def document(tokenizer, tokens: int) -> str:
    """About `tokens` tokens of MT-bench's questions, one after another."""
    return tokenizer.decode(long_context.prompts(tokenizer, [tokens])[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts", nargs="+", help="ARTIFACT[@PROVIDER[:OPENVINO_PRECISION_HINT]], e.g. "
                   "artifacts/x@openvino:bf16")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--prompts", default="builtin", help="builtin, mtbench[:K per category], gsm8k[:N] or a .jsonl")
    p.add_argument("--n", type=int, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--trees", default="tuned", help="'tuned' (the artifact's tuned or default tree), 'sized' "
                   "(that tree sized each cycle by this machine's step costs, what a call naming no tree gets) "
                   "and/or total_tokens/depth/top_k[+lookup] items (4/1/2+4: a 4-token lookup branch), comma-separated")
    p.add_argument("--context", type=int, default=0, help="tokens of a document before each question (a system "
                   "message of MT-bench text, the same for every prompt): decoding at that context")
    p.add_argument("--peers", default="", help="genai,llamacpp,openvino-genai (bash ci/install_peers.sh)")
    p.add_argument("--peer-model", default="smollm2-135m", help="the model alias the peers decode, or .gguf files "
                   "of the same weights for the llama.cpp peer (comma-separated: one peer each)")
    p.add_argument("--reference", help="also report top-1 agreement and perplexity against this artifact (e.g. fp32; "
                   "for the artifacts this process runs)")
    p.add_argument("--worker", action="append", default=[], metavar="PROVIDER=PYTHON",
                   help="run the artifacts of PROVIDER (ipex, openvino, ...) in a worker process under the "
                   "interpreter PYTHON (e.g. ipex=.venv-ipex/bin/python), interleaved with the rest; repeatable")
    p.add_argument("--report", help="write the Markdown table here")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--plot", help="write tokens/s against tree size, peers as lines, here")
    a = p.parse_args(argv)
    prompts = load_prompts(a.prompts)[: a.n]
    workers = dict(w.split("=", 1) for w in a.worker if "=" in w)
    if len(workers) != len(a.worker):
        raise SystemExit(f"--worker takes PROVIDER=PYTHON, got {', '.join(a.worker)}")
    providers = {path: provider_of(path, a.provider) for path in a.artifacts}
    remote = {path: workers[p] for path, p in providers.items() if p in workers}
    configs = [c for path in a.artifacts for c in
               (worker_configs(path, remote[path], a.provider, a.trees, a.max_new_tokens) if path in remote
                else artifact_configs(path, a.provider, a.trees, a.max_new_tokens, reuse=a.context > 0))]
    # the peers' context: the document, the question and the reply
    configs += peer_configs([x for x in a.peers.split(",") if x], a.peer_model, a.max_new_tokens,
                            a.context + 2048) if a.peers else []
    first = Path(split_spec(a.artifacts[0], a.provider)[0])
    tokenizer = ChatTokenizer(first / read_manifest(first, False)["tokenizer"])
    system = [{"role": "system", "content": document(tokenizer, a.context)}] if a.context else []
    ids = [tokenizer.apply_chat_template(system + [{"role": "user", "content": q.text}]) for q in prompts]
    measure(configs, ids, a.max_new_tokens)
    rows = summarize(configs)
    header = (f"{len(prompts)} prompts ({a.prompts}) x {a.max_new_tokens} new tokens, greedy; {cpu_name()}, "
              f"{platform.machine()}; python -m runtime.bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    report = markdown(rows, header)
    quality = None
    if a.reference:
        quality = {path: agreement(path, a.reference, a.provider, ids, a.max_new_tokens) for path in a.artifacts
                   if path not in remote}
        report += "\n" + "\n".join(f"{Path(k).name} vs {Path(a.reference).name}: top-1 agreement "
                                   f"{v['top1_agreement']:.3f}, perplexity {v['perplexity']:.2f} "
                                   f"(reference {v['perplexity_reference']:.2f}), {v['tokens']} tokens"
                                   for k, v in quality.items()) + "\n"
    print(report)
    if a.report:
        Path(a.report).write_text(report)
    if a.json:
        Path(a.json).write_text(json.dumps({"header": header, "rows": rows, "quality": quality,
                                            "prompts": [q.__dict__ for q in prompts]}, indent=2) + "\n")
    if a.plot:
        plot(rows, a.plot, header.split(";")[0] + f"; {cpu_name()}")
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
