"""The server as a Ray Serve application (runtime/serve/ray.py): two replicas behind Ray's HTTP
proxy on loopback, in one module-scoped local Ray cluster (num_cpus=2), shut down at the end.

Skips when ray[serve] is not installed (bash ci/install_serve.sh --ray installs it).
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: bash ci/install_serve.sh")
httpx = pytest.importorskip("httpx", reason="the Ray tests need httpx: bash ci/install_serve.sh")
ray = pytest.importorskip("ray", reason="Ray Serve is optional: bash ci/install_serve.sh --ray")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is optional: bash ci/install_serve.sh --ray")

import runtime  # noqa: E402
from runtime.serve import ray as serve_ray  # noqa: E402

MAX_LENGTH = 512
REPLICAS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return tiny_artifact("tiny-llama", "fp32")


@pytest.fixture(scope="module")
def ref(artifact):
    return runtime.load(artifact, max_length=MAX_LENGTH, threads=1)


@pytest.fixture(scope="module")
def ray_url(artifact):
    if ray.is_initialized():
        pytest.skip("a Ray cluster is already initialized in this process")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2 ** 20, log_to_driver=False,
             configure_logging=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(serve_ray.application(artifact, max_length=MAX_LENGTH, replicas=REPLICAS),
                  name=serve_ray.APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _text(reply, stream: bool):
    """(text, finish_reason) from a non-streamed JSON body or an SSE body."""
    if not stream:
        choice = json.loads(reply.body)["choices"][0]
        return choice["text"], choice["finish_reason"]
    parts, finish, done = [], None, False
    for line in reply.body.splitlines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            for choice in json.loads(line[6:])["choices"]:
                parts.append(choice["text"])
                finish = choice["finish_reason"] or finish
    assert done, reply.body[-200:]
    return "".join(parts), finish


def _replicas_running() -> int:
    status = serve.status().applications[serve_ray.APP_NAME].deployments[serve_ray.DEPLOYMENT]
    return status.replica_states.get("RUNNING", 0)


def test_requests_spread_over_both_replicas(ray_url, ref):
    specs = [{"prompt": f"spread {i}", "max_tokens": 24, "temperature": 0, "stream": i % 2 == 1} for i in range(16)]
    wants = [ref.generate(s["prompt"], max_new_tokens=24) for s in specs]

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(serve_ray.post_with_retry(client, ray_url + "/v1/completions", s)
                                          for s in specs))

    replies = asyncio.run(run())
    for spec, reply, want in zip(specs, replies, wants, strict=True):
        assert reply.status == 200, reply
        assert _text(reply, spec["stream"]) == (want.text, want.finish_reason)
    seen = Counter(r.headers["x-replica-id"] for r in replies)
    assert len(seen) == REPLICAS, seen
    assert all(name.startswith("SERVE_REPLICA::") for name in seen)
    health = httpx.get(ray_url + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["workers"] == 1      # one Generator per replica


def test_killing_a_replica_mid_load_loses_no_unstarted_request(ray_url, ref, capsys, long_prompt):
    prompt = long_prompt(ref, 200)
    lengths = (120, 150, 180)
    expected = {n: ref.generate(prompt, max_new_tokens=n) for n in lengths}
    specs = [{"prompt": prompt, "max_tokens": lengths[i % 3], "temperature": 0, "stream": i % 2 == 1}
             for i in range(30)]
    wants = [expected[s["max_tokens"]] for s in specs]
    url = ray_url + "/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i, spec):
                await asyncio.sleep(0.02 * i)                  # arrivals spread over ~0.6 s
                return await serve_ray.post_with_retry(client, url, spec)

            async def kill_a_busy_replica():
                await asyncio.sleep(0.3)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:             # pick a replica that is generating now
                    health = (await client.get(ray_url + "/health")).json()
                    if health["busy"]:
                        ray.kill(ray.get_actor(health["replica"], namespace="serve"), no_restart=True)
                        return health["replica"]
                    await asyncio.sleep(0.01)
                raise AssertionError("no replica was busy")

            victim, *replies = await asyncio.gather(kill_a_busy_replica(), *(one(i, s) for i, s in enumerate(specs)))
            return victim, replies

    victim, replies = asyncio.run(run())
    broken = [r for r in replies if r.broken_after_start]
    retried = [r for r in replies if r.attempts > 1]
    for spec, reply, want in zip(specs, replies, wants, strict=True):
        if reply.broken_after_start:
            continue                                           # it had started streaming: allowed to break
        assert reply.status == 200, (reply.status, reply.attempts, reply.body[:200])
        assert _text(reply, spec["stream"]) == (want.text, want.finish_reason)
    by_victim = sum(r.headers.get("x-replica-id") == victim for r in replies)
    # Ray's controller replaces the killed replica; the application serves on.
    start, deadline = time.monotonic(), time.monotonic() + 60
    while _replicas_running() < REPLICAS:
        assert time.monotonic() < deadline, serve.status()
        time.sleep(0.5)
    with capsys.disabled():
        print(f"\nray kill: {len(replies)} requests, replica {victim} killed mid-load; {by_victim} answered by it "
              f"before, {len(retried)} retried after failing before any content (all then answered), "
              f"{len(broken)} broke after content had started streaming; {REPLICAS} replicas running again "
              f"{time.monotonic() - start:.1f} s after the load ended")
    r = httpx.post(url, json={"prompt": "after", "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == ref.generate("after", max_new_tokens=8).text
