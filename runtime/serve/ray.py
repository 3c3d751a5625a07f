"""The OpenAI-compatible server as a Ray Serve application.

    python -m runtime serve ARTIFACT --ray --replicas 2 [--port 8000] [--host 127.0.0.1]
    python -m runtime serve ARTIFACT --ray --min-replicas 1 --max-replicas 4      # autoscaling
    serve run runtime.serve.ray:build_app artifact=/path/to/artifact replicas=2  # Ray's own CLI / config file

Each replica is one Ray actor holding one Generator (its own graphs and KV caches) and the same
FastAPI app as `python -m runtime serve`, so the endpoints, error shapes, stop strings and metrics
are identical. Ray's HTTP proxy spreads requests over the replicas. Every response names the
replica that produced it in the X-Replica-Id header (and in the "eagle" extension): that name is
the replica actor's name, so `ray.get_actor(name, namespace="serve")` finds it.

When a replica dies, the requests it was running or holding fail with a 5xx (or a dropped
connection). Ray's proxy does not retry them, so clients retry a request that failed before its
first byte of content: `post_with_retry` below does that for the non-streaming and streaming
cases, and the tests measure that no such request is lost when a replica is killed under load.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from dataclasses import dataclass

from ray import serve

from .app import create_app
from .pool import load_pool

log = logging.getLogger("runtime.serve")

DEPLOYMENT = "eagle2"
APP_NAME = "eagle2"
# Requests the proxy may route to one replica at once: the replica runs one and queues the rest in
# its own pool, so a small number keeps the router balancing instead of piling onto one replica.
MAX_ONGOING = 4
GRACEFUL_SHUTDOWN_S = 30               # a stopping replica waits this long for its open requests


@serve.deployment(name=DEPLOYMENT, max_ongoing_requests=MAX_ONGOING, health_check_period_s=2,
                  health_check_timeout_s=10, graceful_shutdown_wait_loop_s=0.5,
                  graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S)
@serve.ingress()                      # the ASGI app is built per replica, after __init__
class EagleReplica:
    def __init__(self, artifact: str, provider: str = "cpu", max_length: int | None = None,
                 threads: int | None = None, max_queue: int = MAX_ONGOING, api_key: str | None = None,
                 parallel: int = 1):
        replica = serve.get_replica_context().replica_id.to_full_id_str()
        self.artifact, self.api_key = artifact, api_key
        self.pool = load_pool(artifact, 1, max_queue, provider, max_length, threads or 1, replica=replica,
                              parallel=parallel)
        log.info("replica %s loaded %s", replica, artifact)

    def __serve_build_asgi_app__(self):
        return create_app(self.pool, self.artifact, self.api_key)

    def check_health(self):
        # Ray calls this periodically; a replica whose worker thread pool died is restarted.
        if self.pool.closed:
            raise RuntimeError("the worker pool is shut down")


def deployment_options(replicas: int = 1, min_replicas: int | None = None, max_replicas: int | None = None,
                       replica_cpus: float = 1.0) -> dict:
    """Fixed replicas, or autoscaling between min and max on ongoing requests per replica."""
    options = {"ray_actor_options": {"num_cpus": replica_cpus}}
    if min_replicas is not None or max_replicas is not None:
        low = min_replicas if min_replicas is not None else 1
        high = max_replicas if max_replicas is not None else max(low, replicas)
        if not 0 <= low <= high or high < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas >= 1, got {low}..{high}")
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1),
                                         "target_ongoing_requests": 2, "upscale_delay_s": 5,
                                         "downscale_delay_s": 60}
    else:
        options["num_replicas"] = replicas
    return options


def application(artifact, provider: str = "cpu", max_length: int | None = None, max_queue: int = MAX_ONGOING,
                api_key: str | None = None, replicas: int = 1, min_replicas: int | None = None,
                max_replicas: int | None = None, replica_cpus: float = 1.0, parallel: int = 1):
    """The bound Ray Serve application (pass it to serve.run); each replica decodes up to `parallel`
    requests side by side."""
    threads = max(1, int(replica_cpus))
    options = deployment_options(replicas, min_replicas, max_replicas, replica_cpus)
    return EagleReplica.options(**options).bind(str(os.path.abspath(artifact)), provider, max_length, threads,
                                                max_queue, api_key, parallel)


def build_app(args: dict):
    """Entry point for `serve run runtime.serve.ray:build_app artifact=DIR replicas=2` and for
    config files (import_path: runtime.serve.ray:build_app, args: {artifact: DIR, ...})."""
    def num(key, kind):
        return kind(args[key]) if args.get(key) not in (None, "") else None

    return application(args["artifact"], provider=args.get("provider", "cpu"), max_length=num("max_length", int),
                        max_queue=num("max_queue", int) or MAX_ONGOING, api_key=args.get("api_key"),
                        replicas=num("replicas", int) or 1, min_replicas=num("min_replicas", int),
                        max_replicas=num("max_replicas", int), replica_cpus=num("replica_cpus", float) or 1.0,
                        parallel=num("parallel", int) or 1)


def main(a) -> int:
    """`python -m runtime serve ARTIFACT --ray ...`: start (or join) Ray, deploy, serve until SIGTERM/SIGINT,
    then delete the application (each replica finishes its open requests first) and exit 0."""
    import ray
    ray.init(address=a.ray_address, include_dashboard=False, configure_logging=False)
    # After ray.init, which installs its own SIGTERM handler (exit at once).
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: stop.set())
    serve.start(http_options={"host": a.host, "port": a.port})
    app = application(a.artifact, a.provider, a.max_length, a.max_queue, a.api_key, a.replicas, a.min_replicas,
                      a.max_replicas, a.replica_cpus, a.parallel)
    serve.run(app, name=APP_NAME, route_prefix="/")
    print(f"Ray Serve application '{APP_NAME}' running on http://{a.host}:{a.port}", flush=True)
    while not stop.wait(0.5):
        pass
    print(f"shutting down: draining the replicas (up to {GRACEFUL_SHUTDOWN_S} s)", flush=True)
    serve.delete(APP_NAME)         # waits for the replicas' graceful shutdown (open requests finish)
    serve.shutdown()
    ray.shutdown()
    print("drained; exiting", flush=True)
    return 0


# Client side: a dead replica's requests are not retried by Ray's proxy.

RETRY_STATUSES = {500, 502, 503, 504}


@dataclass
class Reply:
    status: int                        # HTTP status; 0 when the connection broke
    headers: dict
    body: str                          # the whole body (SSE text for streamed requests)
    attempts: int
    broken_after_start: bool = False   # content had arrived when the connection broke: not retried


async def post_with_retry(client, url: str, body: dict, attempts: int = 4, backoff_s: float = 0.25) -> Reply:
    """POST an OpenAI request through httpx.AsyncClient `client`, retrying when it failed before any
    content arrived (the connection dropped, or the proxy answered 5xx because the replica died).
    A body that breaks after content arrived is not retried (the caller may have shown part of
    it); it comes back with status 0 and broken_after_start. Retrying is safe for greedy and seeded
    requests, which give the same answer again."""
    import httpx
    for attempt in range(1, attempts + 1):
        parts: list[str] = []
        try:
            async with client.stream("POST", url, json=body) as r:
                if r.status_code in RETRY_STATUSES and attempt < attempts:
                    await r.aread()
                    await asyncio.sleep(backoff_s * attempt)
                    continue
                async for chunk in r.aiter_text():
                    parts.append(chunk)
                return Reply(r.status_code, dict(r.headers), "".join(parts), attempt)
        except httpx.TransportError:
            if parts:
                return Reply(0, {}, "".join(parts), attempt, broken_after_start=True)
            if attempt == attempts:
                return Reply(0, {}, "", attempt)
            await asyncio.sleep(backoff_s * attempt)
    return Reply(0, {}, "", attempts)
