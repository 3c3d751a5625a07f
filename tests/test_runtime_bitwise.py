"""Speculation is lossless only if verifying a tree computes every node exactly as plain decoding
computes the same token: each row of a verify step must be bitwise equal to the one-token steps
along that node's own path, whatever the step size, the tree shape and the masked keys between
the node's ancestors. This holds for ONNX artifacts with exact attention, fp32,
int8, w8a8 and w8a16, as long as the step stays inside one block of the attention's key sums, which the runtime
ensures; for those with kernel attention (the default on x86-64: this project's operator, no key blocks);
and for IPEX artifacts (bf16, weight-only int8) and plain torch bf16 ones.

The IPEX cases run in .venv-ipex (ci/test_ipex.sh) and skip elsewhere."""
import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

import runtime
from eagle2 import tree_from_parents
from export.onnx_export import export_onnx
from export.onnx_graph import EXACT_KEY_BLOCK, INT8_BLOCK
from export.torch_export import IPEX_BF16_NEEDS, ipex_bf16_runs
from models.cpu import cpu_name, int8_dot_products
from models.llama import CausalLM, EagleHead
from models.registry import load_checkpoint
from models.tiny import randomize
from models.weights import Checkpoint

# Step sizes: plain decoding (1), the CPU trees, EAGLE-2's 60-token tree, and a prefill chunk.
STEP_SIZES = (1, 2, 3, 4, 5, 8, 13, 16, 31, 60, 128)
BLOCK = EXACT_KEY_BLOCK  # ONNX artifacts' key block (torch artifacts have smaller ones)
MAX_LENGTH = 2 * BLOCK
# Every artifact kind whose manifest says verify_exact (torch and IPEX fp32 do not: their GEMMs round
# products of 1, 2-12 and 16+ rows differently).
# "int8/64", "w8a16/64": weight blocks of 64 (export --int8-block 64; the default is 32); ":exact",
# ":kernel": export --attention exact or kernel.
KINDS = [("onnx", "fp32:exact"), ("onnx", "int8:exact"), ("onnx", "int8/64:exact"), ("onnx", "w8a8:exact"),
         ("onnx", "fp32:kernel"), ("onnx", "int8:kernel"), ("onnx", "w8a8:kernel"), ("onnx", "w8a16:kernel"),
         ("onnx", "w8a16/64:kernel"), ("onnx", "w8a16:exact"), ("torch", "bf16"), ("ipex", "bf16"),
         ("ipex", "int8")]
NEEDS_INT8_DOT = "w8a8 artifacts need VNNI or AMX, which this CPU lacks (the runtime refuses them)"
HAS_IPEX = importlib.util.find_spec("intel_extension_for_pytorch") is not None


def export(checkpoint, path, target: str, precision: str, threads: int | None = None):
    if target == "onnx":
        precision, _, attention = precision.partition(":")
        precision, _, block = precision.partition("/")
        export_onnx(checkpoint, path, precision, max_length=MAX_LENGTH, verify=False, log=lambda m: None,
                    int8_block=int(block or INT8_BLOCK), attention=attention or None)
    else:
        from export.torch_export import export_torch
        export_torch(checkpoint, path, target, precision, max_length=MAX_LENGTH, verify=False, log=lambda m: None)
    return runtime.load(path, provider="cpu" if target == "onnx" else target, threads=threads)


def reshaped_checkpoint(seed: int, source: str, **config) -> Checkpoint:
    """tiny-llama with other sizes (`config`: ModelConfig fields) and random weights of its own."""
    ckpt = load_checkpoint("tiny-llama")
    cfg = dataclasses.replace(ckpt.cfg, **config)
    g = torch.Generator().manual_seed(seed)
    base, head = CausalLM(cfg), EagleHead(dataclasses.replace(cfg, num_layers=1))
    randomize(base, g)
    randomize(head, g)
    return dataclasses.replace(ckpt, cfg=cfg, head_cfg=head.cfg, state=base.state_dict(),
                               head_state=head.state_dict(), source=source)


def mha_checkpoint() -> Checkpoint:
    """tiny-llama with as many kv heads as query heads: the exact attention batches over tokens then."""
    return reshaped_checkpoint(3, "tiny-llama with 4 kv heads", num_kv_heads=load_checkpoint("tiny-llama").cfg.num_heads)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "mha"])
def checkpoint(request):
    return mha_checkpoint() if request.param == "mha" else load_checkpoint(request.param)


@pytest.fixture(scope="module", params=KINDS, ids=[f"{t}-{p}" for t, p in KINDS])
def generator(request, checkpoint, tmp_path_factory):
    target, precision = request.param
    if target == "ipex" and not HAS_IPEX:
        pytest.skip("intel-extension-for-pytorch is not installed here (ci/test_ipex.sh runs these)")
    if precision.startswith("w8a8") and not int8_dot_products():
        pytest.skip(NEEDS_INT8_DOT)
    if (target, precision) == ("ipex", "bf16") and not ipex_bf16_runs():
        pytest.skip(IPEX_BF16_NEEDS)
    gen = export(checkpoint, tmp_path_factory.mktemp("bitwise") / "artifact", target, precision)
    if target != "onnx" and not gen.engine.base.attention_in_order(gen.manifest):
        pytest.skip(f"this CPU ({cpu_name()}) sums the torch graphs' attention keys in an order that depends on "
                    "where they sit (PyTorch's fp32 GEMMs, seen on AMD Zen 3, 4 and 5): torch artifacts claim no "
                    "exactness here")
    # Everywhere else exactness is expected: the load-time branching-tree check must find it.
    assert gen.verify_exact, "verification of a branching tree differs from plain decoding at load"
    return gen


def prefill(engine, prompt):
    for start in range(0, len(prompt), 128):
        engine.prefill(prompt[start:start + 128], start)


def path_to(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def decode_alone(engine, prompt, tokens):
    """Plain decoding of `tokens` after the prompt: (logits, hidden state, cache rows) of the last."""
    prefill(engine, prompt)
    for i, token in enumerate(tokens):
        logits = engine.verify(tree_from_parents([token], [-1]), len(prompt) + i)
        engine.commit(np.array([0]), len(prompt) + i)
    return logits[0].copy(), engine.solo.last_hidden[0].copy()


def random_tree(rng, size, vocab):
    parents = np.array([-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, size)])
    return tree_from_parents(rng.integers(0, vocab, size), parents)


@pytest.mark.parametrize("size", STEP_SIZES)
def test_every_verified_row_equals_the_token_decoded_alone(generator, size):
    engine = generator.engine
    vocab = generator.manifest["model"]["config"]["vocab_size"]
    rng = np.random.default_rng(size)
    # Trees at the very end of one of the artifact's key blocks, at the start of the next and across
    # where a block half as long would end (kernel attention has none: the exact attention's, then).
    block = min(engine.key_block, BLOCK)
    for context in (block - size, block, block + (block - size) // 2):
        prompt = rng.integers(0, vocab, context)
        tree = random_tree(rng, size, vocab)
        prefill(engine, prompt)
        logits = engine.verify(tree, context).copy()
        hidden = engine.solo.last_hidden.copy()
        for node in rng.permutation(size)[:12]:
            alone_logits, alone_hidden = decode_alone(engine, prompt, tree.tokens[path_to(tree.parents, node)])
            np.testing.assert_array_equal(logits[node], alone_logits, err_msg=f"node {node} of {size}, context {context}")
            np.testing.assert_array_equal(hidden[node], alone_hidden, err_msg=f"node {node} of {size}")


def wide_head_checkpoint() -> Checkpoint:
    """tiny-llama with SmolLM2's head size (64): value products as wide as a real model's, which ONNX
    Runtime splits between threads once it has 4 or more."""
    return reshaped_checkpoint(5, "tiny-llama with head_dim 64", hidden_size=256, num_heads=4, num_kv_heads=2,
                               head_dim=64)


@pytest.mark.parametrize("precision", ["fp32:exact", "int8:exact", "int8/64:exact", "w8a8:exact", "int8:kernel",
                                       "w8a16:kernel"])
def test_verified_rows_do_not_depend_on_the_thread_count(precision, tmp_path):
    """8 threads (more than this machine's cores: it is how many split a product that matters): every
    row of a tree still equals the token decoded alone, at contexts spanning several 128-key blocks."""
    if precision.startswith("w8a8") and not int8_dot_products():
        pytest.skip(NEEDS_INT8_DOT)
    gen = export(wide_head_checkpoint(), tmp_path / "artifact", "onnx", precision, threads=8)
    engine, vocab = gen.engine, gen.manifest["model"]["config"]["vocab_size"]
    rng = np.random.default_rng(8)
    for size, context in ((3, 300), (8, 700), (16, 500)):
        prompt = rng.integers(0, vocab, context)
        tree = random_tree(rng, size, vocab)
        prefill(engine, prompt)
        logits = engine.verify(tree, context).copy()
        for node in range(size):
            alone, _ = decode_alone(engine, prompt, tree.tokens[path_to(tree.parents, node)])
            np.testing.assert_array_equal(logits[node], alone, err_msg=f"node {node} of {size}, context {context}")


def test_a_tree_across_a_key_block_is_not_exact(tmp_path):
    """Why the runtime clips trees at key blocks: children placed past a block's end, while decoded alone
    they sit inside it, are summed in another order. If this starts to pass, ONNX Runtime's blocking
    changed and EXACT_KEY_BLOCK with it."""
    gen = export(load_checkpoint("tiny-llama"), tmp_path / "fp32", "onnx", "fp32:exact")
    engine, vocab = gen.engine, gen.manifest["model"]["config"]["vocab_size"]
    rng = np.random.default_rng(9)
    context = BLOCK - 2
    prompt = rng.integers(0, vocab, context)
    tree = tree_from_parents(rng.integers(0, vocab, 8), np.array([-1] + [0] * 7))  # children at BLOCK - 1 ...
    prefill(engine, prompt)
    logits = engine.verify(tree, context).copy()
    past_block = [node for node in range(2, 8)  # slots BLOCK and later; alone at position BLOCK - 1
                  if not np.array_equal(logits[node], decode_alone(engine, prompt, tree.tokens[[0, node]])[0])]
    assert past_block, "no child past the block's end differs from plain decoding"


def test_committed_tree_path_leaves_the_cache_plain_decoding_leaves(generator):
    """After accepting a path, the cache rows are those plain decoding writes, bitwise."""
    engine = generator.engine
    vocab = generator.manifest["model"]["config"]["vocab_size"]
    rng = np.random.default_rng(7)
    context = 140
    prompt = rng.integers(0, vocab, context)
    tree = random_tree(rng, 24, vocab)
    path = np.array(path_to(tree.parents, int(np.argmax(tree.depths))))
    prefill(engine, prompt)
    engine.verify(tree, context)
    engine.commit(path, context)
    caches = [a[:, :, context:context + len(path)].copy() for a in engine.base.cache_arrays()]
    decode_alone(engine, prompt, tree.tokens[path])
    for got, want in zip(caches, engine.base.cache_arrays()):
        np.testing.assert_array_equal(got, want[:, :, context:context + len(path)])


def test_trees_never_straddle_a_key_block(generator, monkeypatch):
    """The decoder clips each tree to the room left in the current key block."""
    engine = generator.engine
    if generator.manifest["attention"] == "kernel":
        assert generator.manifest["exact_key_block"] is None
        pytest.skip("kernel attention sums a row's keys in one list: it has no blocks to clip trees at")
    assert engine.key_block <= engine.max_length, "an exact artifact's attention sums keys in blocks"
    steps = []
    verify_rows = engine.verify_rows
    monkeypatch.setattr(engine, "verify_rows", lambda tree, context, seq: steps.append((context, len(tree.tokens)))
                        or verify_rows(tree, context, seq))
    prompt = [3 + i % 250 for i in range(engine.key_block - 5)]
    generator.generate(prompt, max_new_tokens=40, total_tokens=16, depth=4, top_k=4)
    assert steps and all(c // engine.key_block == (c + t - 1) // engine.key_block for c, t in steps)
    assert any(c + t == engine.key_block for c, t in steps), "no tree was clipped at the block's end"


@pytest.mark.parametrize("tree", [(4, 2, 2), (8, 3, 3), (60, 5, 10)])
def test_speculative_greedy_equals_plain_greedy(generator, tree):
    vocab = generator.manifest["model"]["config"]["vocab_size"]
    rng = np.random.default_rng(11)
    for length in (3, 30, 120, 250):
        prompt = rng.integers(0, vocab, length).tolist()
        plain = generator.generate(prompt, max_new_tokens=60, speculative=False)
        spec = generator.generate(prompt, max_new_tokens=60, total_tokens=tree[0], depth=tree[1], top_k=tree[2])
        assert spec.token_ids == plain.token_ids, length
