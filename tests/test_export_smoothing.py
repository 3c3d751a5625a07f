"""SmoothQuant for the w8a8 precision (export/smoothing.py): the folded weights compute the same
function, the layer inputs it smooths get narrower, and w8a8 artifacts say how they were made."""
import numpy as np
import pytest
import torch

import runtime
from artifact.manifest import read_manifest
from export.onnx_export import export_onnx
from export.smoothing import SMOOTHED, activation_maxima, smooth
from models.cpu import int8_dot_products
from models.llama import CausalLM, KVCache, causal_bias
from models.registry import load_checkpoint
from runtime.backend import ProviderError


@pytest.fixture(scope="module", params=[("tiny-llama", True), ("tiny-qwen2", True), ("tiny-llama", False),
                                        ("tiny-qwen2", False)], ids=lambda p: f"{p[0]}-{'resident' if p[1] else 'layers'}")
def smoothed(request):
    """Calibrated with the whole model over its greedy replies (resident) or a layer at a time."""
    name, resident = request.param
    ckpt = load_checkpoint(name)
    state = {k: v.float().numpy() for k, v in ckpt.state.items()}
    maxima, _ = activation_maxima(ckpt.cfg, state, ckpt.tokenizer, resident)
    return ckpt, state, maxima, dict(smooth(ckpt.cfg, state, maxima)), resident


def logits(cfg, state, ids):
    model = CausalLM(cfg).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    with torch.no_grad():
        out, _ = model(ids, torch.arange(ids.shape[1])[None], causal_bias(ids.shape[1]), KVCache(cfg, ids.shape[1]), 0)
    return out.numpy()


def test_smoothing_keeps_the_function(smoothed):
    ckpt, state, _, new, _ = smoothed
    ids = torch.randint(0, ckpt.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    want, got = logits(ckpt.cfg, state, ids), logits(ckpt.cfg, new, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    changed = [k for k in state if not np.array_equal(state[k], new[k])]
    assert changed and all(".layers." in k for k in changed)  # never the embedding, final norm or lm_head


def test_smoothing_narrows_the_inputs_it_quantizes(smoothed):
    """What a row's one scale has to cover: the spread of channel maxima, before and after."""
    ckpt, state, maxima, new, resident = smoothed
    after, _ = activation_maxima(ckpt.cfg, new, ckpt.tokenizer, resident)
    assert set(maxima) == {f"{i}.{m}" for i in range(ckpt.cfg.num_layers) for m in SMOOTHED}
    spread = {k: m.max() / np.median(m) for k, m in maxima.items()}
    assert all(after[k].max() / np.median(after[k]) < spread[k] for k in maxima)


@pytest.mark.skipif(not int8_dot_products(), reason="w8a8 needs VNNI or AMX, which this CPU lacks")
def test_w8a8_artifact_records_its_smoothing(tiny_artifact):
    manifest = read_manifest(tiny_artifact("tiny-llama", "w8a8"))
    assert manifest["precision"] == "w8a8" and manifest["draft_precision"] == "int8"
    assert manifest["smoothing"]["method"] == "SmoothQuant" and manifest["verify_exact"]


def test_w8a8_is_refused_without_int8_dot_products(tmp_path, monkeypatch):
    export_onnx(load_checkpoint("tiny-llama"), tmp_path / "a", "w8a8", max_length=64, verify=False, log=lambda m: None)
    monkeypatch.setattr("models.cpu.cpu_flags", lambda: {"sse4_2", "avx2", "fma"})
    with pytest.raises(ProviderError, match="AVX512-VNNI, AVX-VNNI or AMX"):
        runtime.load(tmp_path / "a")


@pytest.mark.parametrize("flags, precision", [({"avx512f", "avx512_vnni", "amx_tile", "amx_int8"}, "w8a8"),
                                              ({"avx512f", "avx512bw", "avx512_vnni"}, "w8a16"), ({"avx2", "fma"}, "w8a16")])
def test_default_precision_follows_the_cpu_kind(flags, precision, monkeypatch):
    """The export's default follows the CPU exporting: w8a8 where AMX makes its verified rows cheap,
    w8a16 on the other x86-64 kinds; the default precision keeps the plain artifact name."""
    from export.cli import default_out
    from export.common import default_precision
    monkeypatch.setattr("models.cpu.cpu_flags", lambda: flags)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert default_precision() == precision
    assert default_out("smollm2-135m", precision).name == "smollm2-135m"
    other = "int8" if precision == "w8a8" else "w8a8"
    assert default_out("smollm2-135m", other).name == f"smollm2-135m-{other}"
