"""EAGLE's training loss of a head on one batch, and the metrics that come with it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.llama import Eagle3Head, EagleHead

from .batches import Batch
from .train_eagle3 import eagle3_losses
from .unroll import unrolled_forward


def head_losses(head: EagleHead, emb: torch.Tensor, lm: torch.Tensor, batch: Batch, noise: float,
                generator: torch.Generator | None, ce_fraction: float = 1.0, unroll: int = 1) -> dict:
    """EAGLE's loss on one batch. With ce_fraction < 1 the cross-entropy term (whose full-vocabulary
    lm_head dominates the cost on CPU) is estimated on a random subset of the trained positions.

    unroll > 1 adds a training-time test (as in HASS and EAGLE-3): step j feeds the head its own
    predicted features from step j - 1, shifted by one position, with the attention context a
    depth-j tree node has at inference, so deep drafts are trained on the inputs they really get.
    Step j's loss is weighted 0.8^(j-1); the metrics acc/top5 are step 1's, acc_j step j's.
    An EAGLE-3 head gets its own loss (training.train_eagle3), without the feature noise."""
    if isinstance(head, Eagle3Head):
        return eagle3_losses(head, emb, lm, batch, generator, ce_fraction, unroll)
    device = batch.hidden.device
    feats_in = batch.hidden[:, :-1]
    if noise > 0:
        feats_in = feats_in + (torch.rand(feats_in.shape, generator=generator, device=device) - 0.5) * noise
    tok = F.embedding(batch.ids[:, 1:], emb)
    target_all = batch.hidden[:, 1:]
    trained = batch.loss_mask.nonzero()  # [N, 2] (row, position)
    n = trained.shape[0]
    if n == 0:
        zero = next(unrolled_forward(head, tok, feats_in, 1)).sum() * 0
        return {"loss": zero, "vloss": zero.detach(), "ploss": zero.detach(), "acc": 0.0, "top5": 0.0, "n": 0}
    ce_rows = trained
    if ce_fraction < 1.0:
        keep = torch.randperm(n, generator=generator, device=device)[:max(1, round(n * ce_fraction))]
        ce_rows = trained[keep]
    with torch.no_grad():  # the base's distribution at the CE positions, shared by all steps
        target_logits = target_all[ce_rows[:, 0], ce_rows[:, 1]] @ lm.T
        target_p = torch.softmax(target_logits, -1)
        target_top = target_logits.argmax(-1)
    result = {}
    for step, out in enumerate(unrolled_forward(head, tok, feats_in, unroll), 1):
        # A depth-`step` draft needs step - 1 verified positions before it.
        rows = trained[trained[:, 1] >= step - 1]
        ce = ce_rows[:, 1] >= step - 1
        if rows.shape[0] == 0 or not bool(ce.any()):
            break
        pred = out[rows[:, 0], rows[:, 1]]
        vloss = F.smooth_l1_loss(pred, target_all[rows[:, 0], rows[:, 1]], reduction="none").mean(-1).mean()
        logq = torch.log_softmax(out[ce_rows[ce, 0], ce_rows[ce, 1]] @ lm.T, -1)
        ploss = -(target_p[ce] * logq).sum(-1).mean()
        with torch.no_grad():
            top5 = logq.topk(5, -1).indices
            hit = top5 == target_top[ce, None]
            acc, acc5 = hit[:, 0].float().mean().item(), hit.any(-1).float().mean().item()
        loss = (vloss + 0.1 * ploss) * 0.8 ** (step - 1)
        if step == 1:
            result = {"loss": loss, "vloss": vloss.detach(), "ploss": ploss.detach(), "acc": acc, "top5": acc5,
                      "n": n}
        else:
            result["loss"] = result["loss"] + loss
            result[f"acc_{step}"], result[f"n_{step}"] = acc, int(ce.sum())
    return result
