#!/usr/bin/env bash
# Idempotent set-up of the serve extra in .venv: FastAPI, uvicorn, prometheus-client and llguidance
# (structured output) for `python -m runtime serve`, with httpx and the openai client (the dev extra) for its tests. With
# --ray, also Ray Serve (`python -m runtime serve --ray`, tests/test_server_ray.py). Versions come
# from pyproject.toml; pip runs only when something is missing (0.2 s otherwise).
#   bash ci/install_serve.sh          # about 7 s on a fresh .venv here
#   bash ci/install_serve.sh --ray    # plus about 26 s for ray[serve]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    bash ci/install.sh
fi
. .venv/bin/activate
# Installed distributions, looked up without importing them (importing ray takes seconds).
have() { python -c "import importlib.metadata as m, sys; [m.version(d) for d in sys.argv[1:]]" "$@" 2> /dev/null; }
if ! have fastapi uvicorn prometheus-client llguidance httpx openai; then
    python -m pip install -q -e ".[serve,dev]"
fi
if [ "${1:-}" = "--ray" ] && ! have ray aiohttp starlette; then
    python -m pip install -q -e ".[ray]"
fi
