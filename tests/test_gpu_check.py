"""The torch backend's accelerator path (runtime/torch_device.py) and its GPU check (tools/gpu_check.py).

On a CPU: the quick check passes; the traced graphs carry no device of their own; the device path,
run here on the CPU with its CUDA graphs replaced by eager stand-ins of the same bucketing and
static outputs, decodes exactly as the host path and keeps hidden states and logits as tensors;
compaction moves the rows it should; the projection's arithmetic. On a CUDA machine also: the same
on the GPU, CUDA graphs against eager steps."""
import json

import numpy as np
import pytest
import torch

import runtime
import runtime.torch_session as torch_session
from export.torch_export import export_torch
from models.registry import load_checkpoint
from artifact.graphs import GraphSpec
from runtime.backend import ProviderError
from runtime.torch_device import DeviceRows, DeviceSteps
from tools import gpu_check
from tools.projection import (PUBLISHED, anchored_q1, fit_rank_model, interpolated, large_model_projection,
                              modelled_tau, project, tau_file)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: torch.cuda.is_available() is False")
PROMPT = list(range(10, 60))
TREE = dict(total_tokens=12, depth=3, top_k=4)


@pytest.fixture(scope="module")
def fp16_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "tiny-llama-fp16"
    export_torch(load_checkpoint("tiny-llama"), path, "torch", "fp16", max_length=256, verify=False, log=lambda m: None)
    return path


class EagerGraph:
    """A CUDA graph's stand-in on the CPU: replay runs the captured step again into the same outputs."""

    def __init__(self, steps, args):
        self.steps, self.args = steps, args
        self.outs = steps._call(args)

    def replay(self):
        with torch.inference_mode():
            for out, new in zip(self.outs, self.steps._call(self.args)):
                out.copy_(new)


@pytest.fixture
def device_path_on_cpu(monkeypatch):
    """runtime.load(..., provider="torch") now takes the accelerator path, graphs and all, on the CPU."""
    monkeypatch.setattr(torch_session, "HOST_DEVICES", ())
    monkeypatch.setattr(DeviceSteps, "_capture", lambda self, args: (lambda g: (g, g.outs))(EagerGraph(self, args)))

    def load(path, graphs: bool):
        gen = runtime.load(path, provider="torch")
        for session in (gen.engine.base, gen.engine.draft):
            session.steps.graphs = {} if graphs else None
        gen.stop_ids.clear()
        return gen
    return load


def test_quick_cpu_check_passes(tmp_path):
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["failures"] == []
    rows = {r["model"]: r for r in result["rows"]}
    assert set(rows) == {"tiny-llama", "tiny-qwen2", "tiny-llama-v24"}
    assert all(r["greedy"]["ok"] for r in rows.values()) and rows["tiny-llama-v24"]["sampling"]["ok"]
    assert set(rows["tiny-llama"]["verify_ms"]) == {str(n) for n in gpu_check.SIZES}
    assert "not CUDA" in result["onnxruntime_cuda"]["skipped"]
    report = (tmp_path / "gpu_check.md").read_text()
    assert report.count("| model |") == 1 and "PROJECTION, not a measurement" in report


def test_traced_graphs_carry_no_device(fp16_artifact):
    """A device baked in at tracing (torch.arange does that) would put a CPU tensor into a CUDA step."""
    for name in ("base", "draft"):
        graph = str(torch.jit.load(str(fp16_artifact / f"{name}.pt")).graph)
        assert "Device = prim::Constant" not in graph, name


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "bucketed"])
def test_device_path_decodes_as_the_host_path(fp16_artifact, device_path_on_cpu, graphs):
    host = runtime.load(fp16_artifact, provider="torch")
    host.stop_ids.clear()
    dev = device_path_on_cpu(fp16_artifact, graphs)
    assert isinstance(dev.engine.features, torch.Tensor)
    for kwargs in (dict(speculative=False), TREE, dict(TREE, temperature=1.0, seed=1)):
        want = host.generate(PROMPT, max_new_tokens=40, **kwargs)
        got = dev.generate(PROMPT, max_new_tokens=40, **kwargs)
        assert got.token_ids == want.token_ids and got.accept_lengths == want.accept_lengths, kwargs
    if graphs:  # trees of 12 run as 16 rows, one-token steps as themselves, prompts of 50 as 64
        assert {(16, 16), (1, 1), (64, 1)} <= set(dev.engine.base.steps.graphs)


def test_device_path_compacts_as_the_host_path(tmp_path, device_path_on_cpu, monkeypatch):
    """The 24-token model accepts often enough for accepted nodes to move into place in the cache."""
    export_torch(gpu_check.sampling_checkpoint(), tmp_path / "v24", "torch", "fp16", max_length=64, verify=False,
                 log=lambda m: None)
    host = runtime.load(tmp_path / "v24", provider="torch")
    host.stop_ids.clear()
    dev = device_path_on_cpu(tmp_path / "v24", graphs=True)
    moves = []
    move = DeviceSteps.move
    monkeypatch.setattr(DeviceSteps, "move", lambda self, source, destination: (moves.append(source),
                                                                                  move(self, source, destination)))
    prompt = gpu_check.SAMPLING_PROMPT
    for kwargs in [TREE] + [dict(TREE, temperature=1.0, seed=seed) for seed in range(4)]:
        want = host.generate(prompt, max_new_tokens=40, **kwargs)
        got = dev.generate(prompt, max_new_tokens=40, **kwargs)
        assert got.token_ids == want.token_ids and got.accept_lengths == want.accept_lengths, kwargs
    assert len(moves) >= 5


def test_logits_and_hidden_states_stay_on_the_device(fp16_artifact, device_path_on_cpu):
    gen = device_path_on_cpu(fp16_artifact, graphs=True)
    e = gen.engine
    e.start(8)
    row = e.prefill(np.arange(10, 18), 0)
    assert isinstance(row, np.ndarray) and row.shape == (gen.vocab_size,)  # prefill's one row crosses
    from eagle2 import tree_from_parents
    logits = e.verify(tree_from_parents(np.array([5, 6, 7]), np.array([-1, 0, 0])), 8)
    assert isinstance(logits, DeviceRows) and logits.shape == (3, gen.vocab_size)
    ids = logits[:3].argmax(-1)
    assert isinstance(ids, np.ndarray) and ids.tolist() == np.asarray(logits).argmax(-1).tolist()
    assert isinstance(e.solo.last_hidden, torch.Tensor)


def test_compaction_moves_rows_on_the_device():
    caches = [{"name": n, "dtype": "float32", "shape": [1, 2, "max_length", w]}
              for n, w in (("past_key_0", 4), ("past_value_0", 5), ("past_key_1", 4), ("past_value_1", 5))]
    spec = {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": [1, "T"]}, *caches], "outputs": []}
    steps = DeviceSteps(torch, None, GraphSpec.parse(spec), "cpu", 32, 8, cuda_graphs=False)
    assert len(steps.stores) == 2 and len(steps.caches) == 4
    for i, c in enumerate(steps.caches):
        c.copy_(torch.arange(32.0).view(1, 1, 32, 1).expand_as(c) + 100 * i)
    before = [c.clone() for c in steps.caches]
    steps.move(np.array([12, 14, 17]), 11)
    for c, b in zip(steps.caches, before):
        assert torch.equal(c[:, :, 11:14], b[:, :, [12, 14, 17]])
        assert torch.equal(c[:, :, :11], b[:, :, :11]) and torch.equal(c[:, :, 14:], b[:, :, 14:])


def test_torch_options_are_checked(fp16_artifact):
    with pytest.raises(ProviderError, match="unknown option"):
        runtime.load(fp16_artifact, provider="torch", provider_options={"graphs": True})
    with pytest.raises(ProviderError, match="cuda_graphs needs a CUDA device"):
        runtime.load(fp16_artifact, provider="torch", provider_options={"cuda_graphs": True})


def test_device_rows_hand_over_what_the_loop_reads():
    logits = torch.tensor([[0.0, 2.0, 2.0], [3.0, 1.0, 0.0]])
    rows = DeviceRows(logits)
    assert rows.argmax(-1).tolist() == [1, 0]  # the first of equal maxima, as numpy
    assert isinstance(rows[:1], DeviceRows) and rows[1].tolist() == [3.0, 1.0, 0.0]
    assert len(rows) == 2 and np.asarray(rows).shape == (2, 3)


def test_projection_arithmetic():
    tau = {"2/2": [0, 1, 1.5, 1.8, 2.0, 2.1]}
    rows = project(tau, {1: 10.0, 2: 11.0, 4: 12.0, 8: 16.0}, {2: 4.0}, 1.0, 10.0)
    # 5 tokens cost the 8-token bucket: 2.1 * 10 / (16 + 4 + 1) = 1.0 < 4 tokens: 2.0 * 10 / 17.
    assert rows == [{"tree": "4/2/2", "tau": 2.0, "cycle_ms": 17.0, "tokens_per_s": 1e3 * 2.0 / 17.0,
                     "speedup": 2.0 * 10.0 / 17.0}]


def test_rank_model_of_the_draft():
    """tau of a tree from a draft whose rank-r candidate is right with probability q1 * beta^(r-1):
    a chain of certain tokens lands them all; a tree never lands more than its depth allows; the fit
    on the shipped head's curves reproduces them closely; the anchor hits the published tau."""
    assert modelled_tau(1.0, 0.0, 3, 1, 5) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    taus = modelled_tau(0.5, 0.5, 2, 4, 64)  # depth 2: three draft levels below the root
    assert all(a <= b for a, b in zip(taus[1:], taus[2:])) and max(taus) <= 1 + 3
    with pytest.raises(ValueError, match="sum to more than 1"):
        modelled_tau(0.9, 0.5, 2, 4, 64)
    fit = fit_rank_model(json.loads(tau_file().read_text())["tau"])
    assert fit["max_relative_error"] < 0.15
    q1 = anchored_q1(fit["beta"], PUBLISHED["tree"], PUBLISHED["tau"])
    assert abs(modelled_tau(q1, fit["beta"], 5, 10, 60)[60] - PUBLISHED["tau"]) < 1e-6


def test_large_model_projection_arithmetic():
    costs = {"machine": "m", "date": "d", "context": 8, "draft_top_k": 2, "plain_ms_per_token": 100.0,
             "verify_ms": {"1": 100.0, "4": 130.0, "8": 190.0}, "verify_vs_one_row": {"4": 1.3},
             "draft_ms_by_depth": {"1": 20.0}}
    assert interpolated(costs["verify_ms"], 6) == 160.0 and interpolated(costs["verify_ms"], 9) is None
    p = large_model_projection([costs], json.loads(tau_file().read_text())["tau"])
    [best] = p["best_by_shape"]
    total = int(best["tree"].split("/")[0])
    assert best["tree"].endswith("/1/2") and 2 <= total <= 7
    assert best["speedup"] == pytest.approx(best["tau"] * 100.0 / (interpolated(costs["verify_ms"], total) + 20.0))


@needs_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_graphs_decode_as_eager_steps(precision, tmp_path):
    path = tmp_path / precision
    export_torch(load_checkpoint("tiny-llama"), path, "torch", precision, max_length=256, verify=False,
                 log=lambda m: None)
    plain = {}
    for graphs in (True, False):
        gen = runtime.load(path, provider="torch", device="cuda", provider_options={"cuda_graphs": graphs})
        gen.stop_ids.clear()
        assert gen.engine.features.is_cuda
        plain[graphs] = gen.generate(PROMPT, max_new_tokens=40, speculative=False).token_ids
        # Trees run padded to their bucket with graphs: other GEMM shapes, which may round otherwise.
        check = gpu_check.greedy_check(gen, [PROMPT], gpu_check.TINY_TREES, 32, gpu_check.TIE[precision])
        assert check["ok"], check["status"]
        steps = gen.engine.base.steps
        assert (steps.graph_error, bool(steps.graphs)) == (None, graphs)
    assert plain[True] == plain[False]  # one-token steps: the same kernels either way


@needs_cuda
def test_speculative_sampling_on_cuda_keeps_the_distribution(tmp_path):
    export_torch(gpu_check.sampling_checkpoint(), tmp_path / "v24", "torch", "fp16", max_length=64, verify=False,
                 log=lambda m: None)
    gen = runtime.load(tmp_path / "v24", provider="torch", device="cuda")
    gen.stop_ids.clear()
    assert gpu_check.sampling_pvalue(gen, 2000) > gpu_check.ALPHA
