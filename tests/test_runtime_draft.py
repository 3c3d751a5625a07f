"""The runtime drafts the tree its head defines. Lossless tests cannot see a drafting bug (a wrong
position, mask or parent feature only lowers acceptance), so every node the engine drafts is
recomputed here by the PyTorch head run plainly over the node's own history: the context rows,
then its ancestors in order, each fed its parent's output as the feature."""
import numpy as np
import pytest
import torch

import runtime
from export.verify import reference_models
from models.llama import KVCache, causal_bias
from models.registry import load_checkpoint

PROMPT = "Once upon a time, in a land far away, there lived"


def head_on_chain(head, emb, tokens, features, chain):
    """The head's output at the end of: rows j < len(features) (token j+1, feature j), then the
    chain of (token, feature) rows that follow them."""
    ids = list(tokens[1:len(features) + 1]) + [t for t, _ in chain]
    feats = np.concatenate([features] + [f[None] for _, f in chain])
    n = len(ids)
    with torch.no_grad():
        out = head(emb[torch.tensor(ids)][None], torch.from_numpy(feats).float()[None], torch.arange(n)[None],
                   causal_bias(n), KVCache(head.cfg, n), 0)
    return out[0, -1]


@pytest.mark.parametrize("target", ["onnx", "torch"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_every_drafted_node_matches_the_head_on_its_ancestor_chain(name, target, tiny_artifact, monkeypatch,
                                                                  tmp_path):
    ckpt = load_checkpoint(name)
    _, head, lm = reference_models(ckpt.cfg, ckpt.state, ckpt.head_cfg, ckpt.head_state, "fp32", "fp32", 512)
    emb = ckpt.state["model.embed_tokens.weight"].float()
    # An fp32 draft graph: int8 rounding, amplified by a random head, would hide small errors.
    if target == "onnx":
        gen = runtime.load(tiny_artifact(name, draft_precision="fp32"), threads=1)
    else:
        from export.torch_export import export_torch
        export_torch(ckpt, tmp_path / "torch", "torch", "fp32", max_length=512, verify=False, log=lambda m: None)
        gen = runtime.load(tmp_path / "torch", provider="torch", threads=1)
    engine = gen.engine
    roots = {}  # context -> (hidden, top-k ids) of the root's draft row
    expansions = {}  # context -> [(tokens, features, mask, hidden, top-k ids)], one per step
    context_rows, expand_rows, finish_draft = engine.draft_context_rows, engine.draft_expand_rows, engine.finish_draft

    def recording_context_rows(next_tokens, start, top_k, seq, prompt=False):
        part = context_rows(next_tokens, start, top_k, seq, prompt)
        part.recorded = ("context", start + len(next_tokens), top_k)
        return part

    def recording_expand_rows(tokens, features, mask, context, step, top_k, seq):
        part = expand_rows(tokens, features, mask, context, step, top_k, seq)
        part.recorded = ("expand", context, step, tokens.copy(), np.array(features), mask.copy(), top_k)
        return part

    def recording_finish(part):
        hidden, ids, logp = finish_draft(part)
        if part.recorded[0] == "context":
            _, end, top_k = part.recorded
            roots[end] = (hidden[-1].copy(), ids[0, :top_k].copy())
        else:
            _, context, step, tokens, features, mask, top_k = part.recorded
            steps = expansions.setdefault(context, [])
            assert len(steps) == step
            steps.append((tokens, features, mask, hidden.copy(), ids[:, :top_k].copy()))
        return hidden, ids, logp

    monkeypatch.setattr(engine, "draft_context_rows", recording_context_rows)
    monkeypatch.setattr(engine, "draft_expand_rows", recording_expand_rows)
    monkeypatch.setattr(engine, "finish_draft", recording_finish)
    top_k, depth = 4, 3
    ids = gen.tokenizer.encode(PROMPT)
    out = gen.generate(ids, max_new_tokens=12, total_tokens=30, depth=depth, top_k=top_k)
    tokens = list(ids) + out.token_ids

    def check(got_hidden, got_top, want_hidden):
        # fp32 rounding reaches ~2e-4 of the largest value on random heads; a wrong position, mask
        # or feature is off by more than 1e-2 (an int8 draft alone by ~1e-2).
        want = want_hidden.numpy()
        assert np.abs(got_hidden - want).max() <= 1e-3 * np.abs(want).max()
        assert set(got_top.tolist()) == set(torch.log_softmax(want_hidden @ lm.float().T, -1).topk(top_k).indices.tolist())

    assert len(expansions) >= 2
    for context, steps in expansions.items():
        features = engine.features[:context]
        root_hidden, root_top = roots[context]
        check(root_hidden, root_top, head_on_chain(head, emb, tokens, features, []))
        for step, (_, _, mask, hidden, drafted) in enumerate(steps):
            for i in range(top_k):
                rows = [divmod(int(r), top_k) for r in np.nonzero(mask[i])[0]]
                assert [s for s, _ in rows] == list(range(step + 1))  # one ancestor per depth, then itself
                # Each row holds a child of the row before it, fed that row's output as its feature.
                parent_hidden, parent_top = root_hidden, root_top
                for s, j in rows:
                    token, feature = steps[s][0][j], steps[s][1][j]
                    assert token in parent_top
                    assert np.array_equal(feature, parent_hidden)
                    parent_hidden, parent_top = steps[s][3][j], steps[s][4][j]
                chain = [(int(steps[s][0][j]), steps[s][1][j]) for s, j in rows]
                check(hidden[i], drafted[i], head_on_chain(head, emb, tokens, features, chain))
