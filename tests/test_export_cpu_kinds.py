"""What an export does on each CPU kind, mocking the CPU's flags: the kind named, the default
precision (the kind's path, recorded in the manifest), the up-front refusal of a precision the CPU
cannot run exactly (exit 1 before any weights load, nothing written, the missing feature and the
precision to use instead named), and the runtime's check at load of the path an artifact took."""
from __future__ import annotations

import json
import logging

import pytest

import runtime
from export.common import ExportError
from export.targets import target
from models.cpu import CPU_KINDS, cpu_kind
from runtime import cpu_fit

AVX2 = {"sse4_2", "avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
KINDS = {  # name: (flags, kind, onnx default, w8a8 runs, ipex default, ipex bf16 runs)
    "AVX2 without VNNI (Zen 2, Haswell)": (AVX2, "avx2", "w8a16", False, "fp32", False),
    "AVX2 with VNNI (Alder Lake)": (AVX2 | {"avx_vnni"}, "avx2-vnni", "w8a16", True, "fp32", False),
    "AVX-512 (Skylake-SP)": (AVX512, "avx512", "w8a16", False, "fp32", False),
    "AVX-512 VNNI (Cascade Lake)": (AVX512 | {"avx512_vnni"}, "avx512-vnni", "w8a16", True, "fp32", False),
    "AVX-512 VNNI and BF16 (Zen 4, Zen 5)": (AVX512 | {"avx512_vnni", "avx512_bf16"}, "avx512-vnni", "w8a16", True,
                                             "bf16", True),
    "AMX (Sapphire Rapids)": (AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}, "amx",
                              "w8a8", True, "bf16", True),
}


@pytest.fixture
def cpu(monkeypatch):
    def use(flags: set[str]) -> None:
        for where in ("models.cpu", "export.torch_export"):
            monkeypatch.setattr(f"{where}.cpu_flags", lambda: set(flags))
        monkeypatch.setattr("platform.machine", lambda: "x86_64")
    return use


@pytest.mark.parametrize("kind", KINDS)
def test_defaults_and_refusals_by_cpu_kind(kind, cpu):
    flags, name, onnx_default, w8a8_runs, ipex_default, bf16_runs = KINDS[kind]
    cpu(flags)
    assert cpu_kind() == name
    onnx, ipex = target("onnx"), target("ipex")
    assert onnx.precision(None, lambda m: None, name) == onnx_default  # --cpu-kind names it from anywhere
    assert onnx.precision(None, lambda m: None) == onnx_default
    assert ipex.precision(None, lambda m: None) == ipex_default
    for chosen, precision, runs, missing in ((onnx, "w8a8", w8a8_runs, "AVX512-VNNI, AVX-VNNI or AMX"),
                                             (ipex, "bf16", bf16_runs, "AVX512-BF16 or AMX")):
        for draft in (None, precision):
            base = "int8" if draft else precision  # also refused as the draft's precision alone
            if runs:
                chosen.check_cpu(base, draft)
            else:
                with pytest.raises(ExportError, match=missing):
                    chosen.check_cpu(base, draft)
    for precision in ("int8", "fp32"):  # every x86-64 CPU runs these
        onnx.check_cpu(precision, "int8")
        ipex.check_cpu(precision, "int8")
    onnx.check_cpu("w8a16", "w8a16")  # every kind has AVX2


def test_defaults_say_why(cpu):
    said = []
    cpu(AVX2)
    assert target("ipex").precision(None, said.append) == "fp32"
    assert "AVX512-BF16 or AMX" in said[-1]
    cpu(KINDS["AMX (Sapphire Rapids)"][0])
    assert target("onnx").precision(None, said.append) == "w8a8"
    assert "--precision int8" in said[-1]


@pytest.mark.parametrize("args, names", [
    (["--precision", "w8a8"], ["--precision w8a8", "AVX512-VNNI, AVX-VNNI or AMX", "--precision int8"]),
    (["--precision", "int8", "--draft-precision", "w8a8"], ["--draft-precision w8a8", "--precision int8"]),
    (["--target", "ipex", "--precision", "bf16"], ["--precision bf16", "AVX512-BF16 or AMX", "fp32 or int8"]),
    (["--cpu-kind", "amx"], ["--cpu-kind amx's path w8a8", "AVX512-VNNI, AVX-VNNI or AMX", "on a CPU that runs"]),
    (["--target", "torch", "--cpu-kind", "avx2"], ["--cpu-kind applies to --target onnx only"]),
])
def test_cli_refuses_before_loading_anything(args, names, cpu, tmp_path, monkeypatch, export_cli):
    from test_export_cli_errors import assert_one_error

    def no_loading(*a, **k):
        raise AssertionError("weights were loaded before the CPU check")
    monkeypatch.setattr("models.registry.load_checkpoint", no_loading)
    cpu(AVX2)
    rc, _, err = export_cli("tiny-llama", *args, "--out", tmp_path / "outs" / "artifact")
    assert rc == 1
    assert_one_error(rc, err, *names)
    assert not (tmp_path / "outs").exists()


def test_w8a16_refused_up_front_without_avx2(cpu, tmp_path, export_cli):
    """w8a16's operator is written for AVX2: a CPU without it is told so, and which precision to use."""
    from test_export_cli_errors import assert_one_error
    cpu({"sse4_2", "avx"})
    rc, _, err = export_cli("tiny-llama", "--precision", "w8a16", "--out", tmp_path / "outs" / "artifact")
    assert_one_error(rc, err, "--precision w8a16", "AVX2", "--precision int8")
    assert not (tmp_path / "outs").exists()
    why = cpu_fit.refusal({"model": {"source": "tiny-llama"}, "precision": "w8a16", "draft_precision": "w8a16"})
    assert "AVX2" in why and "`python -m export tiny-llama --precision int8`" in why


def test_no_kind_off_x86_or_without_avx2(monkeypatch):
    assert cpu_kind({"sse4_2", "avx"}) is None
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert cpu_kind(AVX2) is None


@pytest.fixture(scope="module")
def avx2_path_artifact(tmp_path_factory):
    """A w8a16 export for --cpu-kind avx2 (its path; every x86-64 CPU with AVX2 runs it), through the CLI."""
    from export.cli import main
    out = tmp_path_factory.mktemp("kinds") / "avx2"
    assert main(["tiny-llama", "--cpu-kind", "avx2", "--max-length", "64", "--out", str(out)]) == 0
    return out


def test_the_manifest_records_the_kind_and_its_path(avx2_path_artifact):
    made_for = json.loads((avx2_path_artifact / "manifest.json").read_text())["cpu"]
    assert made_for["kind"] == "avx2" and made_for["path"] == "w8a16"
    assert made_for["precision_from"] == "the CPU kind's path" and made_for["exported_on"]


@pytest.mark.parametrize("kind", KINDS)
def test_loading_another_kinds_path_names_the_export_for_this_cpu(kind, cpu, avx2_path_artifact, caplog):
    """An artifact made for AVX2's path (w8a16) loads on every kind; on AMX, whose path is w8a8, the load
    says which export gives this CPU's path; the other kinds' path is w8a16 too. Its steps are this
    CPU's either way."""
    flags, name = KINDS[kind][:2]
    cpu(flags)
    with caplog.at_level(logging.WARNING, logger="runtime"):
        gen = runtime.load(avx2_path_artifact)
    said = [r.getMessage() for r in caplog.records if "re-export" in r.getMessage()]
    if name != "amx":
        assert said == []
    else:
        assert said == [f"this artifact takes AVX2 without VNNI's path (w8a16, exported on {gen.manifest['cpu']['exported_on']}); "
                        f"the fastest lossless path on this CPU ({CPU_KINDS[name]}) is w8a8: re-export it with "
                        f"`python -m export tiny-llama --cpu-kind {name}` (or the export run on this CPU)"]
    assert gen.generate([1, 2, 3], max_new_tokens=3).token_ids


@pytest.mark.parametrize("precision_from", ["--precision", "the quality gate"])
def test_no_advice_for_a_precision_asked_for_or_gated(precision_from, cpu):
    """A precision the user asked for, or the quality gate fell back to, was not the kind's path."""
    cpu(KINDS["AMX (Sapphire Rapids)"][0])
    manifest = {"model": {"source": "m"}, "precision": "int8",
                "cpu": {"kind": "avx2", "path": "int8", "exported_on": "x", "precision_from": precision_from}}
    assert cpu_fit.advice(manifest) is None
    assert cpu_fit.advice({**manifest, "cpu": None}) is None  # artifacts exported before the record


@pytest.mark.parametrize("kind", [k for k in KINDS if not KINDS[k][3]])
def test_w8a8_refused_at_load_names_this_cpu_and_the_export(kind, cpu):
    flags, name = KINDS[kind][:2]
    cpu(flags)
    for manifest in ({"precision": "w8a8", "draft_precision": "w8a8"}, {"precision": "int8", "draft_precision": "w8a8"}):
        why = cpu_fit.refusal({"model": {"source": "smollm2-135m (a GGUF)"}, **manifest})
        assert f"this CPU ({CPU_KINDS[name]})" in why and "AVX512-VNNI, AVX-VNNI or AMX" in why
        assert f"`python -m export smollm2-135m --cpu-kind {name}`" in why
