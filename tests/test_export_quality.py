"""The export's quality gate (export.quality): top-1 agreement with the fp32 checkpoint recorded in
the manifest; below the threshold an asked-for precision is refused, naming the agreement and a
safer layout, and the default precision falls back to one, saying so. The control paths are driven
by a stand-in measurement on the tiny model; the measurement itself runs for real on the tiny model
(random weights: recorded, not gated) and on SmolLM2 (tests/test_export_smollm2.py)."""
from __future__ import annotations

import pytest

from artifact.manifest import read_manifest
from export.common import default_precision
from export.quality import MIN_AGREEMENT, Agreement


@pytest.fixture
def measured(monkeypatch):
    """measured(fn): top-1 agreement becomes fn(precision, int8_block); fp32 confidently answers."""
    layouts = []

    def use(fn, confidence=0.6):
        def fake(artifact, manifest, cfg, state, tokenizer, resident):
            layout = (manifest["precision"], manifest["int8_block"])
            layouts.append(layout)
            return Agreement(fn(*layout), 700, confidence, "a stand-in measurement")
        monkeypatch.setattr("export.quality.top1_agreement", fake)
        return layouts
    return use


def only_fp32(precision, block):
    return 0.99 if precision == "fp32" else 0.9


def test_safer_layouts_in_order():
    from export.targets import Options, target
    onnx, chain, layout = target("onnx"), [], ("w8a8", Options())
    while layout:
        chain.append(onnx.layout(*layout))
        layout = onnx.safer(*layout)
    assert chain == ["--precision w8a8", "--precision int8", "--precision fp32"]
    assert onnx.layout(*onnx.safer("int8", Options(int8_block=64))) == "--precision int8"  # block 32
    assert onnx.safer("w8a16", Options(int8_block=64)) == ("w8a16", Options())  # block 32
    assert onnx.safer("w8a16", Options()) == ("fp32", Options())
    assert target("ipex").safer("bf16", Options()) == ("fp32", Options())
    assert target("torch").safer("fp32", Options()) is None


def test_default_precision_falls_back_to_a_safer_layout_and_says_so(measured, export_cli, tmp_path):
    layouts = measured(only_fp32)
    rc, out, err = export_cli("tiny-llama", "--out", tmp_path / "a")
    assert rc == 0, err
    manifest = read_manifest(tmp_path / "a")
    assert manifest["precision"] == "fp32"
    assert manifest["quality"]["top1_agreement"] == 0.99 and manifest["quality"]["gated"]
    last_quantized = "w8a16" if default_precision() == "w8a16" else "int8"  # AVX2's path, or int8 after w8a8
    assert [p for p, _ in layouts[-2:]] == [last_quantized, "fp32"]
    assert "agreement with fp32 is 0.900, below 0.97" in err and "falling back to --precision fp32" in err
    assert "exported tiny-llama (fp32, with draft head)" in out


@pytest.mark.parametrize("precision", ["int8", "w8a16"])
def test_asked_precision_below_the_gate_is_refused(precision, measured, export_cli, tmp_path):
    from test_export_cli_errors import assert_one_error
    from export.targets import target
    if why := target("onnx").missing(precision):
        pytest.skip(why)  # w8a16 off AVX2 or without ci/build_kernels.sh
    layouts = measured(lambda precision, block: 0.99 if block == 32 else 0.9)
    (tmp_path / "outs").mkdir()
    rc, _, err = export_cli("tiny-llama", "--precision", precision, "--int8-block", "64",
                            "--out", tmp_path / "outs" / "a")
    assert_one_error(rc, err, f"{precision} export's top-1 agreement with fp32 is 0.900", f"below {MIN_AGREEMENT}",
                     f"export --precision {precision},", "--min-agreement 0.9")
    assert layouts == [(precision, 64)]  # the manifest names the block the weights were stored in
    assert list((tmp_path / "outs").iterdir()) == []


def test_min_agreement_keeps_an_asked_layout(measured, export_cli, tmp_path):
    measured(only_fp32)
    rc, _, err = export_cli("tiny-llama", "--precision", "int8", "--min-agreement", "0.85", "--out", tmp_path / "a")
    assert rc == 0, err
    quality = read_manifest(tmp_path / "a")["quality"]
    assert (quality["top1_agreement"], quality["threshold"]) == (0.9, 0.85)


def test_random_weights_are_measured_not_gated(measured, export_cli, tmp_path):
    measured(lambda precision, block: 0.2, confidence=0.001)
    rc, _, err = export_cli("tiny-llama", "--precision", "int8", "--out", tmp_path / "a")
    assert rc == 0, err
    assert not read_manifest(tmp_path / "a")["quality"]["gated"]
    assert "not gated" in err


def test_tiny_model_quality_is_measured_for_real(tiny_artifact):
    quality = read_manifest(tiny_artifact("tiny-llama", "int8"))["quality"]
    assert quality["positions"] > 100 and 0 <= quality["top1_agreement"] <= 1
    assert not quality["gated"]  # random weights have no answers to keep
