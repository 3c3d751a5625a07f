"""Prompts of several lengths against a server (`python -m runtime.load_bench --contexts 256,2000,4000`):
one request at a time, the same token ids to every server, each length its own text (no prefix in
common, so nothing is reused), greedy, streamed. Reported per length: the time to the first token
(the prompt's prefill, on an idle server) and decode tokens/s after it, and decode speed against
the shortest length's, the ratio that shows what attending over a long cache costs.
"""
from __future__ import annotations

import numpy as np

from .prompts import mtbench_questions
from .stream_client import stream_completion

WARM_UP = [1, 2, 3, 4]


def prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Token ids of MT-bench's questions (both turns, one after another), disjoint slices of each length."""
    ids = tokenizer.encode("\n\n".join(t for q in mtbench_questions() for t in q["turns"]), add_special_tokens=False)
    if sum(lengths) > len(ids):
        raise SystemExit(f"prompts of {'+'.join(map(str, lengths))} tokens need more text than MT-bench's "
                         f"{len(ids)} tokens")
    starts = np.cumsum([0] + lengths[:-1])
    return [ids[s:s + n] for s, n in zip(starts, lengths)]


async def run_lengths(url: str, prompts_: list[list[int]], max_tokens: int, repeats: int,
                      extra: dict) -> list[list[dict]]:
    """Each prompt `repeats` times, one request at a time: [{"ttft", "tokens", "decode_s"}] per prompt.
    `extra`: body fields for this server (llama-server's cache_prompt false: every run fills its prompt)."""
    import httpx
    # A connection per request: llama-server closes kept-alive connections after a streamed reply.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await stream_completion(client, url, WARM_UP, 4, extra)
        out = []
        for ids in prompts_:
            runs = []
            for _ in range(repeats):
                r = await stream_completion(client, url, ids, max_tokens, extra)
                tokens = (r["usage"] or {}).get("completion_tokens", len(r["stamps"]))
                runs.append({"ttft": r["stamps"][0] - r["start"], "tokens": tokens,
                             "decode_s": r["end"] - r["stamps"][0]})
            out.append(runs)
        return out


def summary(label: str, lengths: list[int], results: list[list[dict]]) -> dict:
    rows = []
    for n, runs in zip(lengths, results):
        ttft = float(np.median([r["ttft"] for r in runs]))
        # Tokens after the first over the time after it (the first came with the prefill).
        speed = float(np.median([(r["tokens"] - 1) / r["decode_s"] for r in runs if r["decode_s"] > 0]))
        rows.append({"context": n, "ttft_s": ttft, "prefill_tokens_per_s": n / ttft, "decode_tokens_per_s": speed,
                     "tokens": int(np.median([r["tokens"] for r in runs]))})
    for r in rows:
        r["decode_vs_shortest"] = r["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
    return {"server": label, "rows": rows}


def table(result: dict) -> str:
    lines = [f"one request at a time, prompts of MT-bench text, greedy, up to {result['max_tokens']} new tokens, "
             f"median of {result['repeats']}; {result['machine']}", "",
             "| server | context | time to first token s | prefill tokens/s | decode tokens/s | decode vs shortest |",
             "|---|---|---|---|---|---|"]
    for server in result["servers"]:
        for r in server["rows"]:
            lines.append(f"| {server['server']} | {r['context']} | {r['ttft_s']:.2f} | {r['prefill_tokens_per_s']:.0f} | "
                         f"{r['decode_tokens_per_s']:.1f} | {r['decode_vs_shortest']:.2f}x |")
    return "\n".join(lines)

