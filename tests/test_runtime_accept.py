"""Multi-token acceptance and cache compaction under real load: a tiny base trained for a few
seconds on a repetitive reply, and an EAGLE head trained on it with the project's trainer.
Random heads accept almost nothing; this pair accepts several tokens per cycle, along varied
tree paths, so the compaction of accepted K/V rows decides whether the output stays lossless."""
import json
import random

import pytest
import torch
from safetensors.torch import save_file

import runtime
from export.onnx_export import export_onnx
from models.llama import CausalLM, KVCache, causal_bias
from models.registry import load_checkpoint
from models.tiny import tiny_checkpoint
from training.train_head import main as train_head

REPLY = "the cat sat on the mat and the dog ran to the red house. "


def conversations(n=24, seed=0):
    r = random.Random(seed)
    words = REPLY.split()
    return [[{"role": "user", "content": " ".join(r.choice(words) for _ in range(r.randint(2, 5)))},
             {"role": "assistant", "content": (REPLY * 3)[r.randint(0, 20):][:120]}] for _ in range(n)]


def train_base(ckpt, convs, steps=60):
    """Next-token training of the tiny random Llama on the templated conversations."""
    tok = ckpt.tokenizer
    seqs = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in convs]
    n = min(map(len, seqs))
    batch = torch.tensor([s[:n] for s in seqs])
    torch.manual_seed(0)
    model = CausalLM(ckpt.cfg, 512)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    positions, bias = torch.arange(n)[None].expand(len(seqs), -1), causal_bias(n)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threading costs more than it saves
    try:
        for _ in range(steps):
            logits, _ = model(batch, positions, bias, KVCache(ckpt.cfg, n, batch=len(seqs)), 0)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.startswith("rotary")}


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    convs = conversations()
    ckpt = tiny_checkpoint("llama")
    base_dir = tmp / "base"
    base_dir.mkdir()
    (base_dir / "config.json").write_text(json.dumps(ckpt.cfg.to_hf()))
    save_file(train_base(ckpt, convs), str(base_dir / "model.safetensors"))
    ckpt.tokenizer.save_pretrained(str(base_dir))
    data = tmp / "conversations.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}_0", "messages": c}) + "\n" for i, c in enumerate(convs)))
    train_head(["--base", str(base_dir), "--out", str(tmp / "head"), "--data", str(data), "--max-tokens", "6000",
                "--max-len", "200", "--lr", "3e-3", "--batch-tokens", "1024", "--epochs", "20", "--threads", "1",
                "--log-every", "1000", "--save-every", "1000"])
    export_onnx(load_checkpoint(str(base_dir), head=str(tmp / "head")), tmp / "artifact", "fp32", max_length=256,
                log=lambda m: None)
    return runtime.load(tmp / "artifact", threads=1), convs


@pytest.mark.parametrize("total_tokens,depth,top_k", [(12, 4, 4), (60, 5, 10)])
def test_trained_head_accepts_several_tokens_losslessly(agreeing, total_tokens, depth, top_k):
    gen, convs = agreeing
    taus, paths = [], set()
    for conv in convs[:12]:
        messages = conv[:1]
        spec = gen.chat(messages, max_new_tokens=60, total_tokens=total_tokens, depth=depth, top_k=top_k)
        plain = gen.chat(messages, max_new_tokens=60, speculative=False)
        assert spec.token_ids == plain.token_ids
        taus.append(spec.mean_accept_length)
        paths.update(spec.accept_lengths)
    assert sum(taus) / len(taus) > 1.5
    assert len(paths) >= 3  # short and long accepts both happen


def test_sampling_with_an_agreeing_head_is_reproducible(agreeing):
    gen, convs = agreeing
    a = gen.chat(convs[0][:1], max_new_tokens=40, temperature=0.7, seed=5)
    b = gen.chat(convs[0][:1], max_new_tokens=40, temperature=0.7, seed=5)
    assert a.token_ids == b.token_ids
    assert a.mean_accept_length > 1.2
