"""OpenAI-compatible HTTP server over the runtime: `python -m runtime serve ARTIFACT` (docs/serving.md).

A request meets, in order: app.py (body, authentication, schema.py's strict models, the prompt
tokenized off the event loop and checked up front), pool.py (a bounded FIFO in front of N
Generators, each generating in its own thread; a client that leaves sets its job's cancel event,
which the runtime checks every decoding cycle), responses.py (OpenAI's JSON objects or server-sent
events). metrics.py counts it all for Prometheus; main.py is the command line and uvicorn, whose
SIGTERM drains open requests; ray.py serves the same app from Ray Serve replicas.

    from runtime.serve import ServerThread, create_app, load_pool
    pool = load_pool("artifacts/smollm2-135m", workers=2, max_queue=8)
    with ServerThread(create_app(pool, "artifacts/smollm2-135m")) as url:   # any free loopback port
        ...
"""
try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:              # the runtime itself needs none of these
    raise ImportError(f"python -m runtime serve needs the serve extra ({e.name} is missing): "
                      "pip install 'eagle2-deploy[serve]' or bash ci/install_serve.sh") from e

from .app import create_app
from .main import ServerThread
from .pool import WorkerPool, load_pool

__all__ = ["ServerThread", "WorkerPool", "create_app", "load_pool"]
