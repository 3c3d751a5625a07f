"""`python -m runtime serve` as a real process: concurrent load decoded side by side, and SIGTERM.

The server runs as a subprocess on 127.0.0.1 (a free port it picks and logs); the client is an
asyncio httpx client in this process. Every answer is checked against its own request's expected
text, computed with Generator.generate() before the load starts.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: bash ci/install_serve.sh")
pytest.importorskip("uvicorn", reason="the server needs the serve extra: bash ci/install_serve.sh")
pytest.importorskip("prometheus_client", reason="the server needs the serve extra: bash ci/install_serve.sh")
httpx = pytest.importorskip("httpx", reason="the load tests need httpx: bash ci/install_serve.sh")

import runtime  # noqa: E402
from runtime.load_bench import stop  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOAD_SECONDS = float(os.environ.get("EAGLE2_SERVE_LOAD_SECONDS", "8"))   # bounded: the load runs this long
STREAMS = 32
WORKERS = int(os.environ.get("EAGLE2_SERVE_LOAD_WORKERS", "4"))


@contextmanager
def server_process(artifact, *args, ready_timeout=60.0):
    """Start `python -m runtime serve ARTIFACT --port 0 ARGS`; yield (url, process, log lines).
    Always stopped (SIGKILL if it will not exit) when the block ends."""
    cmd = [sys.executable, "-m", "runtime", "serve", str(artifact), "--port", "0", *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()
    found: dict = {}

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if m and not ready.is_set():
                found["url"] = m.group(1)
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(ready_timeout) or "url" not in found:
            raise AssertionError("the server did not start:\n" + "\n".join(lines))
        yield found["url"], proc, lines
    finally:
        stop(proc, 30)
        reader.join(10)


async def stream_completion(client: httpx.AsyncClient, url: str, path: str, body: dict) -> dict:
    """POST one streaming request; return its text, finish reason, ids seen, timings, status."""
    start = time.perf_counter()
    text, ids, finish, first, done = [], set(), None, None, False
    async with client.stream("POST", url + path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": (await r.aread()).decode(errors="replace")}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            ids.add(chunk["id"])
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
                finish = choice["finish_reason"] or finish
    end = time.perf_counter()
    return {"status": 200, "text": "".join(text), "finish": finish, "ids": ids, "done": done,
            "latency": end - start, "ttft": (first or end) - start, "replica": r.headers.get("x-replica-id")}


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return tiny_artifact("tiny-llama", "fp32")


def load_requests(ref, n=STREAMS):
    """n different requests (chat and completions, greedy and seeded sampling) and their answers."""
    specs = []
    for i in range(n):
        max_tokens = 16 + (i * 7) % 48
        sampling = {"temperature": 0.7, "seed": 100 + i} if i % 4 == 3 else {"temperature": 0}
        if i % 2 == 0:
            messages = [{"role": "user", "content": f"load test question {i}: why is the sky blue?"}]
            body = {"messages": messages, "max_tokens": max_tokens, **sampling}
            want = ref.generate(ref.tokenizer.apply_chat_template(messages), max_new_tokens=max_tokens, **sampling)
            specs.append(("/v1/chat/completions", body, want))
        else:
            prompt = f"Completion {i} begins:"
            body = {"prompt": prompt, "max_tokens": max_tokens, **sampling}
            specs.append(("/v1/completions", body, ref.generate(prompt, max_new_tokens=max_tokens, **sampling)))
    return specs


def test_load_32_streams_over_4_parallel_slots(artifact, capsys):
    ref = runtime.load(artifact, max_length=512, threads=1)
    t0 = time.perf_counter()
    specs = load_requests(ref)
    direct_tps = sum(len(s[2].token_ids) for s in specs) / (time.perf_counter() - t0)
    assert len({s[2].text for s in specs}) == len(specs)      # distinct answers: a mix-up would show
    with server_process(artifact, "--parallel", WORKERS, "--max-queue", 64, "--max-length", 512) as (url, proc, log):

        async def stream_loop(client, k, deadline, results):
            j = k
            while time.perf_counter() < deadline:
                path, body, want = specs[j % len(specs)]
                res = await stream_completion(client, url, path, body)
                res["want"], res["spec"] = want, j % len(specs)
                results.append(res)
                j += 7                                          # walk the specs in a different order per stream

        async def run():
            limits = httpx.Limits(max_connections=STREAMS + 4, max_keepalive_connections=STREAMS + 4)
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
                results: list[dict] = []
                t0 = time.perf_counter()
                await asyncio.gather(*(stream_loop(client, k, t0 + LOAD_SECONDS, results) for k in range(STREAMS)))
                wall = time.perf_counter() - t0
                metrics = (await client.get(url + "/metrics")).text
                return results, wall, metrics

        results, wall, metrics = asyncio.run(run())

    bad = [r for r in results if r["status"] != 200]
    assert not bad, bad[:3]
    wrong = [r for r in results if r["text"] != r["want"].text or r["finish"] != r["want"].finish_reason]
    assert not wrong, [(r["spec"], r["text"][:40], r["want"].text[:40]) for r in wrong[:3]]
    assert all(r["done"] for r in results)
    ids = [i for r in results for i in r["ids"]]
    assert all(len(r["ids"]) == 1 for r in results)             # one response id per stream: nothing mixed in
    assert len(set(ids)) == len(results)                         # and no response delivered twice
    served = sum(float(v) for v in re.findall(r'eagle2_requests_total\{endpoint="/v1/[a-z/]+",status="200"\} (\S+)',
                                              metrics))
    assert served == len(results)                                # the server counted exactly what we got
    lat = [r["latency"] for r in results]
    ttft = [r["ttft"] for r in results]
    tokens = sum(len(r["want"].token_ids) for r in results)
    report = (f"load: {STREAMS} concurrent streams, {WORKERS} decoded side by side, {wall:.1f} s: "
              f"{len(results)} requests, "
              f"{len(results) / wall:.1f} req/s, {tokens / wall:.0f} generated tokens/s; latency p50 "
              f"{percentile(lat, 50) * 1e3:.0f} ms p99 {percentile(lat, 99) * 1e3:.0f} ms; time to first token p50 "
              f"{percentile(ttft, 50) * 1e3:.0f} ms p99 {percentile(ttft, 99) * 1e3:.0f} ms; "
              f"mean latency {statistics.mean(lat) * 1e3:.0f} ms (the same requests one after another through "
              f"generate() in this process, 1 thread: {direct_tps:.0f} tokens/s)")
    with capsys.disabled():
        print("\n" + report)
    assert len(results) >= STREAMS                               # generous sanity bounds only
    assert percentile(lat, 99) < 60


def test_sigterm_drains_in_flight_requests(artifact, long_prompt):
    ref = runtime.load(artifact, threads=1)
    prompt = long_prompt(ref, 200)
    specs = [{"prompt": prompt, "max_tokens": 150 + 10 * i, "temperature": 0} for i in range(6)]
    wants = [ref.generate(prompt, max_new_tokens=s["max_tokens"]) for s in specs]
    with server_process(artifact, "--parallel", 2, "--max-queue", 16, "--drain-timeout", 60) as (url, proc, log):

        async def run():
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
                tasks = [asyncio.create_task(stream_completion(client, url, "/v1/completions", s)) for s in specs]
                # All six are in: two decoding side by side, four queued behind them.
                while True:
                    health = (await client.get(url + "/health")).json()
                    if health["busy"] + health["queued"] == len(specs):
                        break
                    await asyncio.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                try:                                             # a new connection after SIGTERM is refused
                    async with httpx.AsyncClient(timeout=5) as fresh:
                        late = await fresh.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
                    refused = late.status_code == 503
                except httpx.TransportError:
                    refused = True
                return await asyncio.gather(*tasks), refused

        results, refused = asyncio.run(run())
        assert refused
        for res, want in zip(results, wants, strict=True):
            assert res["status"] == 200 and res["done"], res
            assert res["text"] == want.text and res["finish"] == want.finish_reason
        assert proc.wait(30) == 0
    text = "\n".join(log)
    assert "up to 2 requests decoded side by side over one copy, queue 16; EAGLE-2 tree" in text, text
    assert re.search(r"received SIGTERM: draining [12] running and [0-5] queued request\(s\)", text), text
    assert "drained: 6 generation(s) completed in all, 0 cancelled; exiting" in text, text
