"""Multi-turn conversations against a server (`python -m runtime.load_bench --turns M`): N users, each
M turns after one shared system prompt, each turn resending the whole history with the server's own
earlier replies, as chat clients do; at most `concurrency` conversations at once.

The system prompt is built from MT-bench's second-turn questions up to a token count (the same text
for every server); user turns are MT-bench questions, both turns of one question and then the next,
the conversations starting in different categories. Reported by turn: time to first token p50/p95;
over the run: generated tokens/s, the prompt tokens the server reused (its own count: this
project's usage.prompt_tokens_details.cached_tokens, llama-server's timings.cache_n) and peak RSS.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from .prompts import mtbench_questions
from .stream_client import stream_chat


def system_prompt(tokenizer, tokens: int) -> str:
    """Instructions and reference questions, about `tokens` tokens long."""
    text = ("You are a careful assistant. Answer briefly and exactly. The team's reference questions, "
            "for context only:")
    for q in mtbench_questions():
        longer = f"{text}\n- {q['turns'][1]}"
        if len(tokenizer.encode(longer)) > tokens:
            break
        text = longer
    return text


def user_turns(conversations: int, turns: int) -> list[list[str]]:
    """Each conversation's user messages: MT-bench questions (both turns each), one category apart."""
    questions = mtbench_questions()
    categories = list(dict.fromkeys(q["category"] for q in questions))
    by_category = {c: [q for q in questions if q["category"] == c] for c in categories}
    out = []
    for c in range(conversations):
        pool = by_category[categories[c % len(categories)]][c // len(categories):]
        messages = [t for q in pool for t in q["turns"]]
        out.append(messages[:turns])
    return out


async def _turn(client, url: str, messages: list[dict], max_tokens: int) -> dict:
    r = await stream_chat(client, url, messages, max_tokens)
    usage = r["usage"] or {}
    # Reused prompt tokens: OpenAI's usage field (this project), else llama-server's timings.cache_n.
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", r["timings"].get("cache_n"))
    return {"text": r["text"], "ttft": r["stamps"][0] - r["start"] if r["stamps"] else None,
            "tokens": usage.get("completion_tokens", 0), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": cached}


async def run_conversations(url: str, system: str, users: list[list[str]], concurrency: int,
                            max_tokens: int) -> tuple[list[list[dict]], float]:
    """Every conversation's turns ({"messages" sent, "text", "ttft", ...}), and the wall time."""
    import httpx
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(users)):
        queue.put_nowait(i)
    results: list[list[dict]] = [[] for _ in users]

    async def user(client):
        while not queue.empty():
            i = queue.get_nowait()
            messages = [{"role": "system", "content": system}]
            for content in users[i]:
                messages.append({"role": "user", "content": content})
                turn = await _turn(client, url, list(messages), max_tokens)
                results[i].append({"messages": list(messages), **turn})
                messages.append({"role": "assistant", "content": turn["text"]})

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await _turn(client, url, [{"role": "user", "content": "Hello"}], 4)  # warm-up, nothing shared
        start = time.perf_counter()
        await asyncio.gather(*(user(client) for _ in range(concurrency)))
        return results, time.perf_counter() - start


def summary(label: str, n: int, results: list[list[dict]], wall: float, rss: float, want=None) -> dict:
    """One server at one concurrency: TTFT by turn, tokens/s, reuse, RSS, replies as in-process."""
    turns = max(len(r) for r in results)
    by_turn = [[c[t]["ttft"] for c in results if len(c) > t and c[t]["ttft"] is not None] for t in range(turns)]
    flat = [t for c in results for t in c]
    cached = [t["cached_tokens"] for t in flat if t["cached_tokens"] is not None]
    prompt = sum(t["prompt_tokens"] or 0 for t in flat)
    row = {"server": label, "concurrency": n, "conversations": len(results), "turns": turns,
           "ttft_ms": [[1e3 * float(np.percentile(v, q)) for q in (50, 95)] for v in by_turn],
           "tokens_per_s": sum(t["tokens"] for t in flat) / wall, "seconds": wall,
           "reused_share": (sum(cached) / prompt) if cached and prompt else None, "peak_rss_mib": rss}
    if want is not None:
        row["identical_to_in_process"] = sum(t["text"] == w for t, w in zip(flat, want))
        row["replies"] = len(flat)
    return row


def table(result: dict) -> str:
    turns = max(r["turns"] for r in result["rows"])
    head = " | ".join(f"turn {t + 1} TTFT p50 / p95 ms" for t in range(turns))
    lines = [f"{result['conversations']} conversations x {turns} turns after a {result['system_tokens']}-token system "
             f"prompt (MT-bench questions, chat, greedy, at most {result['max_tokens']} tokens a reply); "
             f"{result['machine']}", "",
             f"| server | users at once | {head} | tokens/s | prompt tokens reused | peak RSS MiB | replies as in-process |",
             "|---|---|" + "---|" * turns + "---|---|---|---|"]
    for r in result["rows"]:
        ttft = " | ".join(f"{p50:.0f} / {p95:.0f}" for p50, p95 in r["ttft_ms"])
        reused = "-" if r["reused_share"] is None else f"{100 * r['reused_share']:.0f} %"
        same = f"{r['identical_to_in_process']}/{r['replies']}" if "replies" in r else "-"
        lines.append(f"| {r['server']} | {r['concurrency']} | {ttft} | {r['tokens_per_s']:.1f} | {reused} | "
                     f"{r['peak_rss_mib']:.0f} | {same} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in result["rows"]:
        turns = range(1, len(r["ttft_ms"]) + 1)
        ax.plot(turns, [p50 for p50, _ in r["ttft_ms"]], marker="o", label=f"{r['server']}, {r['concurrency']} at once")
    ax.set_xticks(list(range(1, max(r["turns"] for r in result["rows"]) + 1)))
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, p50 (ms, log scale)")
    ax.set_title(f"multi-turn chat: {result['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
