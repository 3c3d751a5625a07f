"""One streamed, greedy chat or text completion over HTTP, as the load benchmarks send it: what came
back and when (runtime/load_bench.py, runtime/conversations.py, runtime/long_context.py)."""
from __future__ import annotations

import json
import time


async def stream_chat(client, url: str, messages: list[dict], max_tokens: int) -> dict:
    """{"text", "stamps" (perf_counter of each text delta), "start", "end", "usage" (OpenAI's, or None),
    "timings" (llama-server's extension, or {})} of one chat request, streamed with its usage."""
    return await _stream(client, url + "/v1/chat/completions", {"messages": messages}, max_tokens)


async def stream_completion(client, url: str, prompt: list[int], max_tokens: int, extra: dict | None = None) -> dict:
    """The same for a text completion of prompt token ids (`extra`: more body fields)."""
    return await _stream(client, url + "/v1/completions", {"prompt": prompt, **(extra or {})}, max_tokens)


async def _stream(client, endpoint: str, body: dict, max_tokens: int) -> dict:
    start = time.perf_counter()
    body = {**body, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, stamps, usage, timings = [], [], None, {}
    async with client.stream("POST", endpoint, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            delta = "".join(c.get("delta", {}).get("content") or c.get("text") or ""  # chat or completion
                            for c in chunk.get("choices", []))
            if delta:
                text.append(delta)
                stamps.append(time.perf_counter())
    return {"text": "".join(text), "stamps": stamps, "start": start, "end": time.perf_counter(), "usage": usage,
            "timings": timings}
