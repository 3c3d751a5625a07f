"""EAGLE-3 head training (arXiv 2503.01840) on top of training.train_head's data pipeline.

What differs from EAGLE-1/2:
- Features: the inputs of the base layers models.llama.eagle3_layers (low, middle, high),
  concatenated, plus the post-final-norm hidden state whose lm_head gives the training target;
  the cache stores [taps (3H), final (H)] per token.
- The head has its own norm and lm_head over a draft vocabulary: the reply tokens the training
  data uses most (FR-Spec's frequency ranking, stop tokens always in). lm_head starts as the
  base's rows for those tokens and the norm as the base's final norm, so the head starts out
  drafting through the base's own vocabulary projection and only has to learn the feature.
- Loss: cross-entropy against the base's next-token distribution restricted to the draft
  vocabulary, only where the base's top token is in it (elsewhere no draft could be right); no
  feature regression. Training-time test: steps 2..K feed the head its own outputs, as at
  inference (training.unroll.unrolled_forward), weighted 0.8^(step - 1).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.draft_vocab import COUNTS_FILE, select
from models.llama import Eagle3Head

from .unroll import unrolled_forward


def eagle3_config(base: ModelConfig, draft_vocab: int) -> ModelConfig:
    d = base.to_dict()
    d.update(num_layers=1, fc_bias=False, draft_vocab_size=draft_vocab)
    return ModelConfig.from_dict(d)


def reply_counts(data: dict, vocab_size: int) -> np.ndarray:
    """int64 [vocab]: how often each token occurs on the assistant side of the training data."""
    ids = np.asarray(data["ids"], np.int64)[np.asarray(data["mask"], bool)]
    return np.bincount(ids[ids < vocab_size], minlength=vocab_size).astype(np.int64)


def new_eagle3_head(base: ModelConfig, base_state: dict, counts: np.ndarray, draft_vocab: int,
                    n_positions: int) -> Eagle3Head:
    vocab = torch.from_numpy(select(counts, min(draft_vocab, base.vocab_size), list(base.eos_token_ids)))
    head = Eagle3Head(eagle3_config(base, len(vocab)), n_positions)
    lm = base_state.get("lm_head.weight", base_state["model.embed_tokens.weight"])
    with torch.no_grad():
        head.lm_head.weight.copy_(lm[vocab].float())
        head.norm.weight.copy_(base_state["model.norm.weight"].float())
        head.d2t.copy_(vocab - torch.arange(len(vocab)))
    return head


def eagle3_losses(head: Eagle3Head, emb: torch.Tensor, lm: torch.Tensor, batch, generator,
                  ce_fraction: float, unroll: int) -> dict:
    """Loss and metrics on one batch (the keys training.losses.head_losses returns; vloss is 0).
    acc is the share of trained positions where the draft's top token (mapped to base ids) is the
    base's top token, counted over all trained positions, also those whose top token lies outside
    the draft vocabulary: it is the acceptance a depth-1 draft would see."""
    h = head.cfg.hidden_size
    device = batch.hidden.device
    taps = batch.hidden[:, :-1, :-h]
    final = batch.hidden[:, 1:, -h:]
    tok = F.embedding(batch.ids[:, 1:], emb)
    trained = batch.loss_mask.nonzero()
    n = trained.shape[0]
    zero = torch.zeros((), device=device)
    if n == 0:
        out = next(unrolled_forward(head, tok, taps, 1))
        return {"loss": out.sum() * 0, "vloss": zero, "ploss": zero, "acc": 0.0, "top5": 0.0, "n": 0}
    if ce_fraction < 1.0:
        keep = torch.randperm(n, generator=generator, device=device)[:max(1, round(n * ce_fraction))]
        trained = trained[keep]
    vocab = head.vocab
    with torch.no_grad():
        logits = final[trained[:, 0], trained[:, 1]] @ lm.T
        top = logits.argmax(-1)
        in_draft = torch.zeros(lm.shape[0], dtype=torch.bool, device=device)
        in_draft[vocab] = True
        reachable = in_draft[top]
        target_p = torch.softmax(logits[:, vocab], -1)
    result = {"vloss": zero}
    for step, out in enumerate(unrolled_forward(head, tok, taps, unroll), 1):
        # A depth-`step` draft needs step - 1 verified positions before it.
        at = trained[:, 1] >= step - 1
        use = at & reachable
        if not bool(use.any()):
            break
        logq = torch.log_softmax(head.logits(out[trained[use, 0], trained[use, 1]]), -1)
        ploss = -(target_p[use] * logq).sum(-1).mean()
        with torch.no_grad():
            hits = vocab[logq.topk(5, -1).indices] == top[use, None]
            share = float(use.sum()) / float(at.sum())
            acc, acc5 = hits[:, 0].float().mean().item() * share, hits.any(-1).float().mean().item() * share
        loss = ploss * 0.8 ** (step - 1)
        if step == 1:
            result |= {"loss": loss, "ploss": ploss.detach(), "acc": acc, "top5": acc5, "n": int(at.sum())}
        else:
            result["loss"] = result["loss"] + loss
            result[f"acc_{step}"], result[f"n_{step}"] = acc, int(at.sum())
    if "loss" not in result:
        out = next(unrolled_forward(head, tok, taps, 1))
        result |= {"loss": out.sum() * 0, "ploss": zero, "acc": 0.0, "top5": 0.0, "n": int(n)}
    return result


def save_eagle3_head(out: Path, head: Eagle3Head, counts: np.ndarray | None = None) -> None:
    """The official EAGLE-3 layout: config with draft_vocab_size and the Eagle3 architecture;
    fc, midlayer.*, norm, lm_head (fp16), d2t (int64) and t2d (bool over the base vocabulary)."""
    from safetensors.torch import save_file
    cfg = head.cfg.to_hf()
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, bias=False,
               draft_vocab_size=head.cfg.draft_vocab_size, target_hidden_size=head.cfg.hidden_size,
               torch_dtype="float16")
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in head.state_dict().items() if k != "d2t"}
    state["d2t"] = head.d2t.detach().cpu().long().contiguous()
    t2d = torch.zeros(head.cfg.vocab_size, dtype=torch.bool)
    t2d[head.vocab.cpu()] = True
    state["t2d"] = t2d
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if counts is not None:
        np.save(out / COUNTS_FILE, counts)
