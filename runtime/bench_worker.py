"""The configurations of one artifact, decoded in this process on request of a `runtime.bench` run in
another Python environment.

IPEX pins torch 2.8 and onnxruntime-openvino replaces onnxruntime, so they live in environments of
their own (.venv-ipex, .venv-openvino) and cannot share a process with each other or with ONNX
Runtime 1.32. `python -m runtime.bench ... --worker ipex=.venv-ipex/bin/python` starts this module
under that interpreter for each such artifact and interleaves its configurations with the others,
prompt by prompt, as for artifacts of its own process: one run, one table.

Protocol, one JSON object per line: this process first writes its configurations (label, group,
tree, weight bytes, exactness), then answers each {"config": i, "ids": [...]} with the decoded
tokens, the seconds after the first token, and the accept lengths and timings of speculative
decoding; it exits at the end of its input. Anything else it prints goes to stderr.
"""
from __future__ import annotations

import json
import os
import sys


def main(argv=None) -> int:
    spec, provider, trees, max_new = argv if argv is not None else sys.argv[1:]
    # The protocol owns stdout: libraries that print (IPEX, ONNX Runtime warnings) go to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    from .bench import CYCLE_TIMINGS, artifact_configs
    configs = artifact_configs(spec, provider, trees, int(max_new))

    def send(message) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    send([{"label": c.label, "group": c.group, "tree": c.tree, "weight_bytes": c.weight_bytes,
           "draft_bytes": c.draft_bytes, "exact": c.exact} for c in configs])
    for line in sys.stdin:
        request = json.loads(line)
        tokens, seconds, out = configs[request["config"]].run(request["ids"])
        send({"tokens": tokens, "seconds": seconds,
              "accept_lengths": list(out.accept_lengths) if out is not None else None,
              "timings": {k: out.timings[k] for k in CYCLE_TIMINGS} if out is not None else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
