"""OpenVINO GenAI as a peer: its pipelines decoding token ids on request of `runtime.bench` (plain and
prompt-lookup decoding) and `runtime.load_bench` (continuous batching), in a process of its own.

openvino-genai pins its own openvino and transformers, so it lives in .venv-ovgenai
(`bash ci/install_peers.sh`) and this file runs there as a script, by path, importing nothing of
this project: `.venv-ovgenai/bin/python runtime/openvino_genai_worker.py MODEL_DIR MODE [DRAFT_DIR]`.

MODE is `plain` (LLMPipeline), `prompt-lookup` (LLMPipeline with prompt_lookup=True, its
speculative mode that needs no draft model), `eagle3` (LLMPipeline with the EAGLE-3 head in
DRAFT_DIR as its draft model) or `batch` (ContinuousBatchingPipeline). Protocol, one
JSON object per line: this process first writes what it runs, then answers
- {"ids": [...], "n": N}: N tokens decoded greedily after the ids (end of turn ignored), with the
  seconds after the first one;
- {"requests": [[ids], ...], "streams": S, "max_tokens": N}: every request decoded greedily, at most
  S at once, each new one started as soon as another ends, as S clients of a server would; per
  request the tokens, the time to its first token and the gaps between the steps that gave it tokens.
It exits at the end of its input. Anything else it prints goes to stderr.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _config(ov_genai, n: int, exact_length: bool, mode: str):
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = n
    config.do_sample = False
    if exact_length:
        config.min_new_tokens = n
        config.ignore_eos = True
    if mode == "prompt-lookup":
        # GenAI's samples' values for prompt lookup
        config.num_assistant_tokens = 5
        config.max_ngram_size = 3
    elif mode == "eagle3":
        # the fastest of the chains and trees tried with this project's head (docs/benchmarks.md)
        config.num_assistant_tokens = 3
    return config


class _Stamps:
    """A streamer that records when each token arrives."""

    def __init__(self, ov_genai):
        outer = self

        class Streamer(ov_genai.StreamerBase):
            def write(self, token):
                outer.tokens += list(token) if isinstance(token, list) else [token]
                outer.times.append(time.perf_counter())
                return ov_genai.StreamingStatus.RUNNING

            def end(self):
                pass

        self.streamer = Streamer()
        self.tokens: list[int] = []
        self.times: list[float] = []


def decode(pipe, ov_genai, ov, ids: list[int], n: int, mode: str) -> dict:
    import numpy as np
    stamps = _Stamps(ov_genai)
    pipe.generate(ov.Tensor(np.asarray([ids], dtype=np.int64)), _config(ov_genai, n, True, mode), stamps.streamer)
    return {"tokens": stamps.tokens, "seconds": stamps.times[-1] - stamps.times[0]}


def batch(pipe, ov_genai, ov, requests: list[list[int]], streams: int, max_tokens: int) -> dict:
    """Keep `streams` requests in flight, as that many clients would; step until all are done."""
    import numpy as np
    config = _config(ov_genai, max_tokens, False, "batch")
    waiting = list(range(len(requests)))
    live: dict[int, tuple] = {}     # request -> (handle, start)
    out = [{"tokens": 0, "ttft": None, "stamps": [], "ids": []} for _ in requests]
    begin = time.perf_counter()
    while waiting or live:
        while waiting and len(live) < streams:
            i = waiting.pop(0)
            ids = ov.Tensor(np.asarray([requests[i]], dtype=np.int64))
            live[i] = (pipe.add_request(i, ids, config), time.perf_counter())
        pipe.step()
        now = time.perf_counter()
        for i, (handle, start) in list(live.items()):
            if handle.can_read():
                new = [t for o in handle.read().values() for t in o.generated_ids]
                if new:
                    r = out[i]
                    r["ids"] += new
                    r["tokens"] += len(new)
                    r["stamps"].append(now)
                    if r["ttft"] is None:
                        r["ttft"] = now - start
            if handle.get_status() != ov_genai.GenerationStatus.RUNNING and not handle.can_read():
                out[i]["latency"] = now - start
                del live[i]
    wall = time.perf_counter() - begin
    for r in out:
        stamps = r.pop("stamps")
        r["gaps"] = [b - a for a, b in zip(stamps, stamps[1:])]
        r["chunks"] = len(stamps)
    return {"results": out, "wall": wall}


def main(argv=None) -> int:
    model_dir, mode, *draft = argv if argv is not None else sys.argv[1:]
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    import openvino as ov
    import openvino_genai as ov_genai
    if mode == "batch":
        scheduler = ov_genai.SchedulerConfig()
        scheduler.max_num_seqs = 256
        pipe = ov_genai.ContinuousBatchingPipeline(model_dir, scheduler, "CPU")
    else:
        extra = {"prompt_lookup": {"prompt_lookup": True},
                 "eagle3": {"draft_model": ov_genai.draft_model(*draft, "CPU")} if draft else {}}.get(mode, {})
        pipe = ov_genai.LLMPipeline(model_dir, "CPU", **extra)
    core = ov.Core()
    info = {"openvino_genai": ov_genai.get_version(), "mode": mode,
            "inference_precision": str(core.get_property("CPU", "INFERENCE_PRECISION_HINT")),
            "weight_bytes": sum(f.stat().st_size for f in Path(model_dir).glob("openvino_model.bin"))}

    def send(message) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    send(info)
    for line in sys.stdin:
        request = json.loads(line)
        if "requests" in request:
            send(batch(pipe, ov_genai, ov, request["requests"], request["streams"], request["max_tokens"]))
        else:
            send(decode(pipe, ov_genai, ov, request["ids"], request["n"], mode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
