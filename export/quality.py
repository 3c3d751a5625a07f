"""The export's quality gate: teacher-forced top-1 agreement of the exported base graph with the
source checkpoint in fp32, over the replies of the built-in calibration chats
(export.smoothing.CALIBRATION).

Parity (export.verify) checks that a graph computes what its own rounded weights define; this checks
that the rounding kept the model's answers. Every reply position where the graph's most likely
next token differs from fp32's counts against it, so one flipped token early in a reply, which
greedy decoding would follow into another answer, weighs as much as it can.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from models.config import ModelConfig
from models.llama import RMSNorm, causal_bias, forward_layers
from models.tensors import layer_tensors
from models.weights import Checkpoint
from runtime import open_session, target_provider

from .common import ExportError
from .memory import resident_calibration
from .smoothing import calibration_ids, greedy_reply, resident_model

# Below this agreement the export is refused (docs/design.md, "Precisions").
MIN_AGREEMENT = 0.97
# A checkpoint whose fp32 top-1 probability averages below this on the calibration replies has
# no preference to keep (random weights, as the scale checkpoints have): agreement is not gated.
MIN_CONFIDENCE = 0.3
# Reply length: 8 chats x 96 tokens (fewer where a reply ends) resolve agreement to about 0.007.
REPLY_TOKENS = 96


class QualityError(ExportError):
    def __init__(self, message: str, agreement: float):
        super().__init__(message)
        self.agreement = agreement


@dataclass(frozen=True)
class Agreement:
    agreement: float | None  # share of reply positions whose top-1 token equals fp32's
    positions: int
    confidence: float      # fp32's mean probability of its own top-1 token over those positions
    measured_on: str

    @property
    def gated(self) -> bool:
        return self.confidence >= MIN_CONFIDENCE

    def record(self, threshold: float) -> dict:
        return {"top1_agreement": None if self.agreement is None else round(self.agreement, 4),
                "positions": self.positions,
                "fp32_confidence": round(self.confidence, 4), "threshold": threshold,
                "gated": self.gated, "measured_on": self.measured_on}


def reply_sequences(cfg: ModelConfig, state: Mapping, tokenizer, resident: bool) -> tuple[list[tuple[list[int], int]], str]:
    """(ids, first) for each calibration chat: the prompt and a reply, and the first position whose
    next token is the reply's; and what the replies are. `resident`: the fp32 model's own greedy
    replies (what decoding reads); otherwise, where the model does not fit beside the export, the
    chats' fixed replies (one pass a layer at a time)."""
    prompts = calibration_ids(tokenizer, replies=False)
    if resident:
        model = resident_model(cfg, state, max(map(len, prompts)) + REPLY_TOKENS)
        stop = frozenset(i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None)
        replies = [greedy_reply(model, cfg, ids, REPLY_TOKENS, stop)
                   for ids in tqdm(prompts, desc="quality gate: fp32 replies", unit="prompt", file=sys.stderr)]
        return [(ids + r, len(ids) - 1) for ids, r in zip(prompts, replies)], \
            f"the fp32 model's greedy replies to {len(prompts)} built-in chat prompts, teacher-forced"
    out = []
    for prompt, whole in zip(prompts, calibration_ids(tokenizer, replies=True)):
        shared = next((i for i, (a, b) in enumerate(zip(prompt, whole)) if a != b), min(len(prompt), len(whole)))
        out.append((whole, max(shared - 1, 0)))
    return out, f"{len(prompts)} built-in chat prompts with fixed replies, teacher-forced"


@torch.no_grad()
def reference_logits(cfg: ModelConfig, state: Mapping, sequences: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """fp32 logits of the reply positions of each sequence, a layer at a time (any model size)."""
    embed = torch.as_tensor(state["model.embed_tokens.weight"]).float()
    xs = [[embed[torch.tensor([ids])]] for ids, _ in sequences]
    steps = [[(torch.arange(len(ids))[None], causal_bias(len(ids)), 0)] for ids, _ in sequences]
    with tqdm(total=cfg.num_layers, desc="quality gate: fp32 reference", unit="layer", file=sys.stderr) as bar:
        out = forward_layers(cfg, lambda i: {k: torch.as_tensor(v).float() for k, v in
                                             layer_tensors(state, f"model.layers.{i}.").items()},
                             xs, steps, max(len(ids) for ids, _ in sequences), lambda *_: bar.update(1))
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.data = torch.as_tensor(state["model.norm.weight"]).float()
    lm = torch.as_tensor(state["lm_head.weight"] if "lm_head.weight" in state else embed).float()
    return [norm(x[0][0, first:len(ids) - 1]) @ lm.T for x, (ids, first) in zip(out, sequences)]


def graph_logits(artifact, manifest: dict, sequences: list[tuple[list[int], int]]) -> list[np.ndarray]:
    """The exported base graph's logits at the same positions, each chat one prefill."""
    longest = max(len(ids) for ids, _ in sequences)
    provider = target_provider(manifest["target"])
    base = open_session(artifact, manifest["graphs"]["base"], provider, "cpu", longest, longest, 64, None)
    out = []
    for ids, first in sequences:
        t = len(ids)
        bias = causal_bias(t).numpy()
        if manifest["io_dtype"] == "float16":
            bias = bias.astype(np.float16)
        logits = base.run({"input_ids": np.array([ids]), "position_ids": np.arange(t)[None],
                           "attention_bias": bias, "logit_rows": np.arange(first, t - 1)})["logits"]
        out.append(np.array(logits, np.float32).reshape(t - 1 - first, -1))
    return out


def top1_agreement(artifact, manifest: dict, cfg: ModelConfig, state: Mapping, tokenizer, resident: bool) -> Agreement:
    if any(max(ids) >= cfg.vocab_size for ids in calibration_ids(tokenizer, replies=True)):
        return Agreement(None, 0, 0.0, "not measured: the tokenizer gives ids beyond the model's vocabulary")
    sequences, measured_on = reply_sequences(cfg, state, tokenizer, resident)
    limit = manifest["max_length"]  # the graph's rotary table ends there: longer chats are cut
    sequences = [(ids[:limit], first) for ids, first in sequences if first < min(len(ids), limit) - 1]
    if not sequences:
        return Agreement(None, 0, 0.0, f"not measured: the artifact's {limit} positions hold no calibration reply")
    want = reference_logits(cfg, state, sequences)
    got = graph_logits(artifact, manifest, sequences)
    same = np.concatenate([g.argmax(-1) == w.argmax(-1).numpy() for g, w in zip(got, want)])
    confidence = torch.cat([w.softmax(-1).amax(-1) for w in want]).mean().item()
    return Agreement(float(same.mean()), int(same.size), confidence, measured_on)


def check_quality(artifact, manifest: dict, ckpt: Checkpoint, min_agreement: float, log) -> dict:
    """The gate: the manifest's "quality" entry, or QualityError where the export changes the answers
    of a checkpoint that has answers to change (fp32 confident enough to be gated). The fp32 replies
    are the model's own where it fits beside the export (export.memory.resident_calibration)."""
    resident = resident_calibration(ckpt, manifest["target"], manifest["precision"], True)
    measured = top1_agreement(artifact, manifest, ckpt.cfg, ckpt.state, ckpt.tokenizer, resident)
    if measured.agreement is None:
        log(f"quality gate: {measured.measured_on}")
    else:
        log(f"quality gate: top-1 agreement with fp32 {measured.agreement:.3f} over {measured.positions} reply "
            f"positions ({measured.measured_on})" + ("" if measured.gated else
            f"; not gated: fp32's mean top-1 probability {measured.confidence:.3f} is that of random weights"))
    if measured.gated and measured.agreement < min_agreement:
        raise QualityError(f"{manifest['precision']} export's top-1 agreement with fp32 is {measured.agreement:.3f}, "
                           f"below {min_agreement} over {measured.positions} reply positions: it changes this "
                           "model's answers", measured.agreement)
    return measured.record(min_agreement)
