"""What an export does on each CPU kind, mocking the CPU's flags: the default precision, and the
up-front refusal of a precision the CPU cannot run exactly (exit 1 before any weights load, nothing
written, the missing feature and the precision to use instead named)."""
from __future__ import annotations

import pytest

from export.common import ExportError
from export.targets import target

AVX2 = {"sse4_2", "avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
KINDS = {  # name: (flags, onnx default, w8a8 runs, ipex default, ipex bf16 runs)
    "AVX2 without VNNI (Zen 2, Haswell)": (AVX2, "int8", False, "fp32", False),
    "AVX2 with VNNI (Alder Lake)": (AVX2 | {"avx_vnni"}, "int8", True, "fp32", False),
    "AVX-512 (Skylake-SP)": (AVX512, "int8", False, "fp32", False),
    "AVX-512 VNNI (Cascade Lake)": (AVX512 | {"avx512_vnni"}, "int8", True, "fp32", False),
    "AVX-512 VNNI and BF16 (Zen 4)": (AVX512 | {"avx512_vnni", "avx512_bf16"}, "int8", True, "bf16", True),
    "AMX (Sapphire Rapids)": (AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
                              "w8a8", True, "bf16", True),
}


@pytest.fixture
def cpu(monkeypatch):
    def use(flags: set[str]) -> None:
        for where in ("models.cpu", "export.common", "export.torch_export"):
            monkeypatch.setattr(f"{where}.cpu_flags", lambda: set(flags))
        monkeypatch.setattr("platform.machine", lambda: "x86_64")
    return use


@pytest.mark.parametrize("kind", KINDS)
def test_defaults_and_refusals_by_cpu_kind(kind, cpu):
    flags, onnx_default, w8a8_runs, ipex_default, bf16_runs = KINDS[kind]
    cpu(flags)
    onnx, ipex = target("onnx"), target("ipex")
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
