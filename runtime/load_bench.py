"""Serving under load, in one run on one machine: this project's server decoding N requests side by
side (`--parallel N`), the same server as it was before batching (`--workers N`, one model copy
each), llama.cpp's own server (`llama-server -np N`, continuous batching) on the model's GGUF, and
OpenVINO GenAI's continuous-batching pipeline on its int8 IR (`openvino-genai`).

    python -m runtime.load_bench ARTIFACT [--prompts mtbench] [--concurrency 1,4,16] [--max-tokens 128]
                                 [--servers parallel,workers,llama-server] [--gguf as-is,Q8_0]
                                 [--report load.md] [--json load.json] [--plot load.png]
    python -m runtime.load_bench ARTIFACT --turns 4 [--conversations 4] [--system-tokens 500]
                                 [--concurrency 1,4] [--max-tokens 96] [--servers parallel,llama-server] ...
    python -m runtime.load_bench ARTIFACT --contexts 256,2000,4000 [--repeats 2] [--max-tokens 128]
                                 [--servers no-reuse,llama-server] ...

Each server runs as its own process on loopback, one start per concurrency N, and N client
streams (OpenAI chat completions, streamed, greedy) take the prompts from one queue. Reported per
server and N: aggregate generated tokens/s over the wall time, time to first token, the gap between
streamed chunks and tokens per chunk (p50/p99), the server's peak RSS (VmHWM); for this project's
servers, whether every reply equals `Generator.generate()` of the same request alone. OpenVINO GenAI
has no server of its own in its Python package: its pipeline is driven in its own process
(runtime/openvino_genai_worker.py) with the same token ids, N requests in flight, each new one added
as another ends, timed per step; no HTTP on its side, which favours it slightly.

With --turns M, conversations instead (runtime/conversations.py): N users, each M turns of
MT-bench questions after one shared system prompt, each turn resending the history with the
server's earlier replies, N at once at most; reported by turn, time to first token p50/p95,
with aggregate tokens/s, the prefix hit rate (the servers' own counts) and peak RSS.

With --contexts, prompts of those lengths one at a time (runtime/long_context.py): prefill time and
decode speed by context, on the same token ids for every server.
`bash ci/install_serve.sh` for the servers, `bash ci/install_llama_server.sh` for llama-server.
Nothing else may run on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from models.cpu import cpu_name

from . import conversations as conversations_
from . import long_context
from .api import load
from .prompts import load_prompts
from .stream_client import stream_chat

ROOT = Path(__file__).resolve().parent.parent
LLAMA_BIN = ROOT / ".peers" / "llama-server" / "bin"
LLAMA_SERVER = LLAMA_BIN / "llama-server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024


@contextmanager
def _process(cmd: list[str], url: str, ready_path: str, timeout: float = 120.0):
    """Start a server; yield its pid once `ready_path` answers 200; stop it (SIGTERM, then SIGKILL)."""
    import httpx
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not start:\n" + "".join(lines[-30:]))
            try:
                if httpx.get(url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield proc.pid
    finally:
        stop(proc, 60)


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM (a server drains its open requests), then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def server_command(kind: str, artifact: str, gguf: Path | None, n: int, port: int, context: int = 2048) -> list[str]:
    if kind == "llama-server":
        # n slots of `context` positions each, all cores, the GGUF's own chat template.
        return [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(n),
                "-c", str(context * n), "-t", str(os.cpu_count()), "--jinja", "--no-webui"]
    mode = {"parallel": ["--parallel", str(n)], "workers": ["--parallel", "1", "--workers", str(n)],
            "no-reuse": ["--parallel", str(n), "--prefix-cache-mb", "0"],
            "fixed-trees": ["--parallel", str(n), "--fixed-trees"]}[kind]
    return [sys.executable, "-m", "runtime", "serve", artifact, "--port", str(port), "--max-queue", "256",
            "--log-level", "warning", *mode]


async def _stream(client, url: str, messages: list[dict], max_tokens: int) -> dict:
    r = await stream_chat(client, url, messages, max_tokens)
    stamps = r["stamps"]
    tokens = r["usage"]["completion_tokens"] if r["usage"] else len(stamps)
    return {"text": r["text"], "tokens": tokens, "ttft": (stamps[0] - r["start"]) if stamps else None,
            "gaps": list(np.diff(stamps)), "chunks": len(stamps), "latency": r["end"] - r["start"]}


async def _load(url: str, requests: list[list[dict]], n: int, max_tokens: int) -> tuple[list[dict], float]:
    import httpx
    queue: asyncio.Queue = asyncio.Queue()
    for i, messages in enumerate(requests):
        queue.put_nowait((i, messages))
    results: list[dict | None] = [None] * len(requests)

    async def worker(client):
        while not queue.empty():
            i, messages = queue.get_nowait()
            results[i] = await _stream(client, url, messages, max_tokens)

    # A connection per request: llama-server closes kept-alive connections after a streamed reply.
    limits = httpx.Limits(max_connections=n + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await _stream(client, url, requests[0], 8)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(n)))
        return results, time.perf_counter() - start


def _summary(kind: str, label: str, n: int, results: list[dict], wall: float, rss: float, want: list[str] | None):
    gaps = [g for r in results for g in r["gaps"]]
    per_chunk = [r["tokens"] / max(r["chunks"], 1) for r in results]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in results)
    row = {"server": label, "kind": kind, "concurrency": n, "requests": len(results), "tokens": tokens,
           "seconds": wall, "tokens_per_s": tokens / wall,
           "ttft_ms": [1e3 * float(np.percentile(ttft, q)) for q in (50, 99)],
           "chunk_gap_ms": [1e3 * float(np.percentile(gaps, q)) for q in (50, 99)] if gaps else [None, None],
           "tokens_per_chunk": float(np.mean(per_chunk)), "peak_rss_mib": rss}
    if want is not None:
        row["identical_to_alone"] = sum(r["text"] == w for r, w in zip(results, want))
    return row


def requantized(source: Path, quant: str) -> Path:
    """The GGUF requantized by llama.cpp's own llama-quantize (built beside llama-server)."""
    from .peers import PEER_DIR
    path = PEER_DIR / f"{source.stem}.{quant}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        subprocess.run([str(LLAMA_BIN / "llama-quantize"), "--allow-requantize", str(source), str(tmp), quant],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp.rename(path)
    return path


def server_plan(servers: list[str], ggufs: list[str]) -> list[tuple[str, str, Path | None]]:
    """(kind, label, weights) of every server to start: llama-server's GGUF, OpenVINO GenAI's IR folder."""
    labels = {"parallel": "this project, side by side", "workers": "this project, N workers",
              "no-reuse": "this project, side by side, prefix reuse off",
              "fixed-trees": "this project, side by side, trees not sized"}
    plan = [(k, labels[k], None) for k in servers if k not in ("llama-server", "openvino-genai")]
    if "llama-server" in servers:
        if not LLAMA_SERVER.is_file():
            raise SystemExit(f"{LLAMA_SERVER} is missing: bash ci/install_llama_server.sh")
        from models.registry import embedded_gguf
        shipped = embedded_gguf()
        for quant in ggufs:
            path = shipped if quant == "as-is" else requantized(shipped, quant)
            name = shipped.stem.rsplit(".", 1)[-1] if quant == "as-is" else quant
            plan.append(("llama-server", f"llama-server {name}", path))
    if "openvino-genai" in servers:
        from .peers import openvino_model
        plan.append(("openvino-genai", "OpenVINO GenAI int8, continuous batching", openvino_model("smollm2-135m")))
    return plan


def _openvino_genai_load(ir: Path, requests: list[list[int]], n: int, max_tokens: int) -> tuple[list[dict], float, float]:
    """(results, wall seconds, peak RSS MiB) of the requests through OpenVINO GenAI's continuous
    batching, n in flight, after a short warm-up as the servers get."""
    from .peers import OpenVinoGenaiWorker
    worker = OpenVinoGenaiWorker(ir, "batch")
    try:
        worker.ask({"requests": requests[:1], "streams": 1, "max_tokens": 8})
        done = worker.ask({"requests": requests, "streams": n, "max_tokens": max_tokens})
        rss = _peak_rss_mib(worker.pid)
    finally:
        worker.close()
    return [{**r, "text": None} for r in done["results"]], done["wall"], rss


@contextmanager
def serving(kind: str, artifact: str, gguf: Path | None, n: int, context: int = 2048):
    """(url, pid) of a server started for n streams (llama-server: of `context` positions each)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with _process(server_command(kind, artifact, gguf, n, port, context), url, "/health") as pid:
        yield url, pid


def run(artifact: str, prompt_spec: str, levels: list[int], max_tokens: int, servers: list[str],
        ggufs: list[str]) -> dict:
    gen = load(artifact, prefix_cache_mb=0)
    requests = [[{"role": "user", "content": p.text}] for p in load_prompts(prompt_spec)]
    ids = [gen.tokenizer.apply_chat_template(m) for m in requests]
    want = [gen.generate(i, max_new_tokens=max_tokens).text for i in ids]
    del gen
    rows = []
    plan = server_plan(servers, ggufs)
    for n in levels:
        for kind, label, gguf in plan:
            if kind == "openvino-genai":
                results, wall, rss = _openvino_genai_load(gguf, ids, n, max_tokens)
                rows.append(_summary(kind, label, n, results, wall, rss, None))
                print(f"{label}, {n} streams: {rows[-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
                continue
            with serving(kind, artifact, gguf, n) as (url, pid):
                results, wall = asyncio.run(_load(url, requests, n, max_tokens))
                rss = _peak_rss_mib(pid)
            rows.append(_summary(kind, label, n, results, wall, rss, None if kind == "llama-server" else want))
            print(f"{label}, {n} streams: {rows[-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    return {"artifact": artifact, "machine": cpu_name(), "prompts": prompt_spec, "requests": len(requests),
            "max_tokens": max_tokens, "rows": rows}


def run_lengths(artifact: str, lengths: list[int], max_tokens: int, servers: list[str], ggufs: list[str],
                repeats: int) -> dict:
    """Prompts of each length (runtime/long_context.py) on every server, one request at a time."""
    tokenizer = load(artifact, prefix_cache_mb=0).tokenizer
    prompts = long_context.prompts(tokenizer, lengths)
    rows = []
    for kind, label, gguf in server_plan(servers, ggufs):
        extra = {"cache_prompt": False} if kind == "llama-server" else {}
        with serving(kind, artifact, gguf, 1, max(lengths) + max_tokens + 64) as (url, _):
            results = asyncio.run(long_context.run_lengths(url, prompts, max_tokens, repeats, extra))
        rows.append(long_context.summary(label, lengths, results))
        print(f"{label}: decode tokens/s by context {[round(r['decode_tokens_per_s'], 1) for r in rows[-1]['rows']]}",
              file=sys.stderr)
    return {"artifact": artifact, "machine": cpu_name(), "max_tokens": max_tokens, "repeats": repeats,
            "servers": rows}


def run_turns(artifact: str, conversations: int, turns: int, system_tokens: int, levels: list[int],
              max_tokens: int, servers: list[str], ggufs: list[str]) -> dict:
    """The conversation workload (runtime/conversations.py) on every server at every concurrency; this
    project's replies checked against a cold in-process generation of the same messages."""
    gen = load(artifact, prefix_cache_mb=0)
    system = conversations_.system_prompt(gen.tokenizer, system_tokens)
    users = conversations_.user_turns(conversations, turns)
    rows = []
    for n in levels:
        for kind, label, gguf in server_plan(servers, ggufs):
            with serving(kind, artifact, gguf, n) as (url, pid):
                results, wall = asyncio.run(conversations_.run_conversations(url, system, users, n, max_tokens))
                rss = _peak_rss_mib(pid)
            want = None if kind == "llama-server" else [
                gen.generate(gen.tokenizer.apply_chat_template(t["messages"]), max_new_tokens=max_tokens).text
                for c in results for t in c]
            rows.append(conversations_.summary(label, n, results, wall, rss, want))
            print(f"{label}, {n} at once: turn TTFT p50 ms "
                  f"{[round(p50) for p50, _ in rows[-1]['ttft_ms']]}", file=sys.stderr)
    return {"artifact": artifact, "machine": cpu_name(), "conversations": conversations,
            "system_tokens": len(gen.tokenizer.encode(system)), "max_tokens": max_tokens, "rows": rows}


def table(result: dict) -> str:
    lines = [f"{result['requests']} requests ({result['prompts']}, chat, greedy, at most {result['max_tokens']} "
             f"tokens each); {result['machine']}", "",
             "| server | streams | tokens/s | vs 1 stream | TTFT p50 / p99 ms | chunk gap p50 / p99 ms | "
             "tokens / chunk | peak RSS MiB | replies as alone |", "|---|---|---|---|---|---|---|---|---|"]
    single = {r["server"]: r["tokens_per_s"] for r in result["rows"] if r["concurrency"] == 1}
    for r in result["rows"]:
        base = single.get(r["server"])
        gap = "/".join("-" if g is None else f"{g:.0f}" for g in r["chunk_gap_ms"])
        same = f"{r['identical_to_alone']}/{r['requests']}" if "identical_to_alone" in r else "-"
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / base:.2f}x | {r['ttft_ms'][0]:.0f} / {r['ttft_ms'][1]:.0f} | {gap} | "
                     f"{r['tokens_per_chunk']:.2f} | {r['peak_rss_mib']:.0f} | {same} |" if base else
                     f"| {r['server']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | - | "
                     f"{r['ttft_ms'][0]:.0f} / {r['ttft_ms'][1]:.0f} | {gap} | {r['tokens_per_chunk']:.2f} | "
                     f"{r['peak_rss_mib']:.0f} | {same} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for server in dict.fromkeys(r["server"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["server"] == server]
        ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=server)
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in result["rows"]})
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("generated tokens/s (all streams)")
    ax.set_title(f"{Path(result['artifact']).name}: {result['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.load_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--prompts", default="mtbench", help="a prompt set (runtime/prompts.py)")
    p.add_argument("--concurrency", default="1,4,16", help="concurrent streams, comma-separated")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--servers", default="parallel,workers,llama-server",
                   help="parallel (this project, side by side), workers (one model copy per worker), no-reuse "
                        "(side by side, prefix reuse off), fixed-trees (side by side, --fixed-trees), llama-server, "
                        "openvino-genai (its continuous batching; not with --turns or --contexts)")
    p.add_argument("--gguf", default="as-is,Q8_0", help="llama-server's GGUFs: as-is (as shipped), Q8_0")
    p.add_argument("--report", help="write the Markdown table here")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--plot", help="write a plot of tokens/s against streams here")
    turns = p.add_argument_group("conversations (--turns M > 1)")
    turns.add_argument("--turns", type=int, default=1, help="turns per conversation; more than 1: conversations")
    turns.add_argument("--conversations", type=int, default=4, help="users, each one conversation")
    turns.add_argument("--system-tokens", type=int, default=500, help="the shared system prompt's length")
    lengths = p.add_argument_group("prompt lengths (--contexts)")
    lengths.add_argument("--contexts", help="prompt lengths in tokens, comma-separated: one request at a time each")
    lengths.add_argument("--repeats", type=int, default=2, help="runs of each length (the median is reported)")
    a = p.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    if "openvino-genai" in a.servers.split(",") and (a.contexts or a.turns > 1):
        raise SystemExit("openvino-genai takes part in the streams benchmark only, not with --turns or --contexts")
    if a.contexts:
        result = run_lengths(a.artifact, [int(n) for n in a.contexts.split(",")], a.max_tokens, a.servers.split(","),
                             a.gguf.split(","), a.repeats)
        report, draw = long_context.table(result), None
    elif a.turns > 1:
        result = run_turns(a.artifact, a.conversations, a.turns, a.system_tokens, levels, a.max_tokens,
                           a.servers.split(","), a.gguf.split(","))
        report, draw = conversations_.table(result), conversations_.plot
    else:
        result = run(a.artifact, a.prompts, levels, a.max_tokens, a.servers.split(","), a.gguf.split(","))
        report, draw = table(result), plot
    print(report)
    if a.report:
        Path(a.report).write_text(report + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    if a.plot and draw is not None:
        draw(result, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
