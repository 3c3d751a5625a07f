"""`python -m runtime serve`: the command line, and uvicorn with a SIGTERM that drains."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import threading
import time
from pathlib import Path

import uvicorn

from artifact.manifest import ArtifactError, read_manifest

from ..backend import ProviderError
from ..providers import can_batch
from .app import ServerState, create_app
from .pool import load_pool

log = logging.getLogger("runtime.serve")
DEFAULT_PARALLEL = 4


def uvicorn_server(app, host: str, port: int, drain_timeout: float, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn Server whose SIGTERM starts a drain (503 for new requests) and exits with status 0."""

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state: ServerState = app.state.server
            if not state.draining:
                state.draining = True
                pool = state.pool
                log.info("received %s: draining %d running and %d queued request(s) (up to %.0f s); "
                         "new requests are refused", signal.Signals(sig).name, pool.busy, pool.waiting, drain_timeout)
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured signal after its shutdown, which would end the process
            # by SIGTERM; a drained shutdown is a normal exit.
            if sig == signal.SIGTERM and hasattr(self, "_captured_signals"):
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                            lifespan="on", access_log=False)
    return DrainingServer(config)


class ServerThread:
    """Serve an app on loopback (any free port) from a background thread, for tests and notebooks:
    `with ServerThread(app) as url: ...`. Leaving the block shuts the server down as SIGTERM does
    (open requests finish first, up to drain_timeout). `python -m runtime serve` runs uvicorn in the
    main thread instead, where it can take signals."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_timeout: float = 10.0):
        self.server = uvicorn_server(app, host, port, drain_timeout, "warning")
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = None

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def parser():
    p = argparse.ArgumentParser(prog="python -m runtime serve",
                                description="OpenAI-compatible HTTP server (chat/completions, SSE streaming); "
                                            "see docs/serving.md")
    p.add_argument("artifact", help="artifact directory made by python -m export; its name is the model id")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed at start)")
    p.add_argument("--parallel", type=int,
                   help="requests decoded side by side, batched over one copy of the model (default 4 where the "
                        "artifact can: ONNX with exact attention on the cpu or cuda provider; else 1)")
    p.add_argument("--workers", type=int, default=1,
                   help="copies of the model, each decoding one request at a time (for artifacts that cannot batch)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a worker; more get 429")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--provider", default="cpu", help="cpu, cuda or openvino")
    p.add_argument("--max-length", type=int, help="KV cache length (default: the artifact's)")
    p.add_argument("--threads", type=int, help="intra-op threads per worker (default: cores / workers)")
    p.add_argument("--prefix-cache-mb", type=float,
                   help="host memory for reusing earlier requests' caches when a prompt starts with their tokens "
                        "(default: 1/8 of the machine's memory where the artifact's steps are exact; 0: off)")
    p.add_argument("--request-timeout", type=float,
                   help="seconds a request may take from its arrival (a request's own \"timeout\" may ask for "
                        "less): its answer then ends with what it has, finish_reason \"length\" (504 if nothing)")
    p.add_argument("--fixed-trees", action="store_true",
                   help="verify the default tree whole every cycle, instead of sizing it by this machine's step "
                        "costs (and decoding plain while trees do not pay)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for open requests")
    p.add_argument("--log-level", default="info")
    ray = p.add_argument_group("Ray Serve (pip install 'eagle2-deploy[ray]')")
    ray.add_argument("--ray", action="store_true", help="deploy on Ray Serve instead (one worker per replica)")
    ray.add_argument("--replicas", type=int, default=1, help="fixed number of replicas")
    ray.add_argument("--min-replicas", type=int, help="autoscaling lower bound (with --max-replicas)")
    ray.add_argument("--max-replicas", type=int, help="autoscaling upper bound")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica")
    ray.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in (("--workers", a.workers), ("--replicas", a.replicas)):
        if value < 1:
            print(f"error: {name} must be >= 1", flush=True)
            return 2
    if a.max_queue < 0:
        print("error: --max-queue must be >= 0", flush=True)
        return 2
    if a.request_timeout is not None and a.request_timeout <= 0:
        print("error: --request-timeout must be > 0", flush=True)
        return 2
    if a.parallel is not None and a.parallel < 1:
        print("error: --parallel must be >= 1", flush=True)
        return 2
    if not _is_loopback(a.host) and not a.api_key:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the model", a.host)
    try:
        manifest = read_manifest(Path(a.artifact), False)   # fail here, not in every worker or replica
    except ArtifactError as e:
        print(f"error: {e}", flush=True)
        return 1
    try:
        if a.parallel is None:
            a.parallel = DEFAULT_PARALLEL if a.workers == 1 and can_batch(manifest, a.provider) else 1
    except ProviderError as e:
        print(f"error: {e}", flush=True)
        return 1
    if a.ray:
        try:
            from .ray import deployment_options, main as ray_main
            deployment_options(a.replicas, a.min_replicas, a.max_replicas, a.replica_cpus)
        except (ArtifactError, ValueError) as e:
            print(f"error: {e}", flush=True)
            return 1
        except ImportError as e:
            print(f"error: --ray needs Ray Serve ({e.name} is missing): pip install 'eagle2-deploy[ray]'", flush=True)
            return 1
        return ray_main(a)
    try:
        pool = load_pool(a.artifact, a.workers, a.max_queue, a.provider, a.max_length, a.threads, parallel=a.parallel,
                         prefix_cache_mb=a.prefix_cache_mb, request_timeout=a.request_timeout,
                         size_trees=not a.fixed_trees)
    except (ArtifactError, ProviderError, ValueError, OSError) as e:
        print(f"error: {e}", flush=True)
        return 1
    uvicorn_server(create_app(pool, a.artifact, a.api_key), a.host, a.port, a.drain_timeout,
                   a.log_level.lower()).run()
    return 0
