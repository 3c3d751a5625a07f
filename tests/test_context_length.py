"""The longest sequence: an export's default max_length is the model's own context, capped where one
sequence's K/V would take too much of the machine's memory; the runtime caps it again where all its
sequence slots at that length would not fit. Each cap is said, naming both numbers."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

import export.common
import runtime.engine
from export.common import default_max_length
from export.onnx_graph import Precision, cache_bytes
from models.cpu import kv_bytes_per_position
from models.registry import load_checkpoint
from runtime.engine import fitting_max_length

GIB = 2**30


def test_the_default_is_the_models_context_where_it_fits():
    cfg = dataclasses.replace(load_checkpoint("tiny-llama").cfg, max_position_embeddings=8192)
    said = []
    assert default_max_length(cfg, said.append) == 8192 and said == []


def test_a_context_beyond_the_machines_memory_is_capped_and_said(monkeypatch):
    cfg = dataclasses.replace(load_checkpoint("tiny-llama").cfg, max_position_embeddings=1 << 20)
    monkeypatch.setattr(export.common, "physical_memory", lambda: 1 * GIB)
    said = []
    length = default_max_length(cfg, said.append)
    assert length * kv_bytes_per_position(cfg) <= GIB // 4 < (length + 64) * kv_bytes_per_position(cfg)
    assert length % 64 == 0
    assert len(said) == 1 and f"max_length {length}" in said[0] and "1048576" in said[0] and "1 GiB" in said[0]


def test_the_cap_counts_the_caches_own_element_size():
    """Kernel attention stores 16-bit caches beside 8-bit weights only; fp32 keeps fp32, fp16 is fp16."""
    sizes = {(p, a): cache_bytes(Precision(p), a) for p in ("fp32", "fp16", "int8") for a in ("exact", "kernel")}
    assert sizes == {("fp32", "exact"): 4, ("fp32", "kernel"): 4, ("fp16", "exact"): 2, ("fp16", "kernel"): 2,
                     ("int8", "exact"): 4, ("int8", "kernel"): 2}


def test_the_runtime_caps_what_its_sequence_slots_could_not_hold(monkeypatch, caplog):
    manifest = {"model": {"config": {"num_layers": 32, "num_kv_heads": 32, "head_dim": 128}}}  # 1 MiB a position
    monkeypatch.setattr(runtime.engine, "physical_memory", lambda: 16 * GIB)
    assert fitting_max_length(manifest, 4096, 1) == 4096
    with caplog.at_level(logging.WARNING, logger="runtime"):
        assert fitting_max_length(manifest, 4096, 4) == 2048
    assert "max_length 2048 instead of 4096" in caplog.text and "4 sequence(s)" in caplog.text


def test_an_artifact_loads_at_its_full_length_here(tiny_artifact):
    gen = runtime.load(tiny_artifact("tiny-llama", "fp32"), parallel=2)
    try:
        assert gen.max_length == gen.manifest["max_length"] == 2048
        out = gen.generate(np.arange(3, 1900) % 250, max_new_tokens=8)
        assert len(out.token_ids) == 8
    finally:
        gen.close()


MEASURE = """
import re, sys, runtime
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
path, parallel = sys.argv[1], int(sys.argv[2])
runtime.load(path, prefix_cache_mb=0).generate([5, 6, 7], max_new_tokens=2)  # libraries and arenas in place
before = rss()
gen = runtime.load(path, parallel=parallel, prefix_cache_mb=0)
gen.generate_many([[5, 6, 7]] * parallel, max_new_tokens=4)
print(rss() - before)
gen.close()
"""


def test_cache_memory_is_taken_as_sequences_grow(tiny_artifact):
    """Eight sequence slots of 8,192 positions would hold about 200 MB of caches, features and bias
    buffers if they were touched up front; short generations touch a few MB."""
    import subprocess
    import sys
    path = tiny_artifact("tiny-llama", "fp32", max_length=8192)
    grown = [int(subprocess.run([sys.executable, "-c", MEASURE, str(path), str(n)], capture_output=True, text=True,
                                check=True).stdout.split()[-1]) for n in (1, 8)]
    assert grown[1] - grown[0] < 48 * 2**20, f"RSS grew {grown[0] >> 20} MiB for 1 slot, {grown[1] >> 20} MiB for 8"
