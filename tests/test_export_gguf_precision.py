"""--precision gguf: a GGUF's quantized blocks kept as they are (Q4_0, Q4_1 with its per-block
constant, Q8_0), on a tiny Llama written to a real GGUF file with gguf's own quantizers."""
import dataclasses

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import runtime  # noqa: E402
from eagle2 import tree_from_parents  # noqa: E402
from export.common import ExportError  # noqa: E402
from export.onnx_export import export_onnx  # noqa: E402
from models.gguf_blocks import GGUFBlocksError, from_gguf_rows, llamacpp_row_order, read_blocks  # noqa: E402
from models.registry import load_checkpoint  # noqa: E402

Q = gguf.GGMLQuantizationType
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_hold_exactly_the_gguf_values(qtype):
    w = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q[qtype])
    blocks = from_gguf_rows(raw, qtype)
    np.testing.assert_array_equal(blocks.dequantize(), gguf.quants.dequantize(raw, Q[qtype]))
    assert blocks.bits == (8 if qtype == "Q8_0" else 4) and (blocks.offsets is not None) == (qtype == "Q4_1")


def test_other_gguf_quantizations_are_refused_by_name():
    with pytest.raises(GGUFBlocksError, match="Q6_K is not supported by --precision gguf"):
        from_gguf_rows(np.zeros((2, 210), np.uint8), "Q6_K")


def write_gguf(ckpt, path):
    """The tiny checkpoint's linear layers as Q4_1 (embedding Q8_0) in llama.cpp's layout, including
    its q/k row permutation. Returns the checkpoint with the weights those blocks hold."""
    writer = gguf.GGUFWriter(str(path), "llama")
    state = dict(ckpt.state)
    for name, t in ckpt.state.items():
        w = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname, qtype = "token_embd.weight", Q.Q8_0
        elif name.endswith("proj.weight"):
            layer, kind = name.split(".")[2], ".".join(name.split(".")[3:5])
            gname, qtype = f"blk.{layer}.{GGUF_NAMES[kind]}.weight", Q.Q4_1
            heads = {"self_attn.q_proj": ckpt.cfg.num_heads, "self_attn.k_proj": ckpt.cfg.num_kv_heads}.get(kind)
            if heads:
                w = w[llamacpp_row_order(w.shape[0], heads)]
        else:
            continue
        raw = gguf.quants.quantize(w, qtype)
        writer.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
        values = gguf.quants.dequantize(raw, qtype)
        if gname.split(".")[-2] in ("attn_q", "attn_k"):
            values = values[np.argsort(llamacpp_row_order(w.shape[0], heads))]
        state[name] = torch.from_numpy(np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dataclasses.replace(ckpt, state=state, gguf_path=path)


@pytest.fixture(scope="module")
def gguf_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    ckpt = write_gguf(load_checkpoint("tiny-llama"), root / "tiny.gguf")
    blocks = read_blocks(ckpt.gguf_path, ckpt.cfg)
    for name, b in blocks.items():  # the reader undoes llama.cpp's permutation: HF row order
        np.testing.assert_array_equal(b.dequantize(), ckpt.state[name].numpy(), err_msg=name)
    export_onnx(ckpt, root / "artifact", "gguf", max_length=512, log=lambda m: None)
    return runtime.load(root / "artifact")


def test_gguf_artifact_is_parity_checked_and_exact_under_speculation(gguf_artifact):
    gen = gguf_artifact
    assert gen.manifest["precision"] == "gguf" and gen.manifest["parity"]["base.logits"] < 0.2
    rng = np.random.default_rng(3)
    for length in (5, 60, 200):
        prompt = rng.integers(0, 256, length).tolist()
        plain = gen.generate(prompt, max_new_tokens=50, speculative=False)
        for tree in ((4, 2, 2), (16, 4, 4)):
            assert gen.generate(prompt, max_new_tokens=50, total_tokens=tree[0], depth=tree[1],
                                top_k=tree[2]).token_ids == plain.token_ids


def test_gguf_tree_rows_equal_tokens_decoded_alone(gguf_artifact):
    e = gguf_artifact.engine
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 256, 140)
    parents = np.array([-1, 0, 0, 1, 2, 2, 3, 6])
    tree = tree_from_parents(rng.integers(0, 256, 8), parents)
    e.start(160)
    e.prefill(prompt[:128], 0)
    e.prefill(prompt[128:], 128)
    rows = e.verify(tree, 140).copy()
    for node in (4, 7):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        e.prefill(prompt[:128], 0)
        e.prefill(prompt[128:], 128)
        for i, n in enumerate(reversed(path)):
            alone = e.verify(tree_from_parents([tree.tokens[n]], [-1]), 140 + i)[0]
        np.testing.assert_array_equal(rows[node], alone)


def test_gguf_precision_needs_a_gguf_source(tmp_path):
    with pytest.raises(ExportError, match="GGUF"):
        export_onnx(load_checkpoint("tiny-llama"), tmp_path / "x", "gguf", log=lambda m: None)
    assert not (tmp_path / "x").exists()
