"""SmoothQuant (arXiv 2211.10438) for the w8a8 precision.

w8a8 quantizes each activation row with one scale (export/onnx_graph.py: Builder._w8a8_linear), so a
few large channels set the scale of a whole row and flatten every other channel's resolution.
SmoothQuant moves that range into the weights: channel j of a linear layer's input is divided by
s_j and the layer's weight column j multiplied by it, which leaves the product unchanged in exact
arithmetic. The division is folded into whatever writes the input, so it costs nothing at run time:
the RMSNorm weight before q/k/v and before gate/up, and up_proj's rows before down_proj (its input
is silu(gate) * up, linear in up). s_j = max|x_j|^alpha / max|W_:j|^(1 - alpha), from the model's
own activations on a fixed calibration set (its prompts and its greedy replies to them).

Measured on SmolLM2-135M with rows scaled by max |x| / 127 (w8a8's first design; teacher-forced
top-1 agreement with fp32 over 16 MT-bench first turns, where the int8 precision gives 0.963): all
layers unsmoothed 0.920, with q/k/v, gate/up and down_proj smoothed 0.952 (alpha 0.4 / 0.6: 0.926 /
0.941 in a PyTorch simulation against 0.947 at 0.5). Rows centred on their range then gave 0.965.
o_proj's input (the attention output) and lm_head's (the final norm's, which is also the draft
head's feature) are left as they are: row-quantizing either alone lost at most 0.004.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from tqdm import tqdm

from models.config import ModelConfig
from models.llama import CausalLM, KVCache, causal_bias

ALPHA = 0.5
# Varied on purpose (chat, code, arithmetic, a list, prose): the maxima should see every kind of text.
CALIBRATION = (
    "What is the capital of France, and why did it become the capital?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test.",
    "A train leaves at 3:40 pm and travels 150 km at 60 km/h. When does it arrive? Show your steps.",
    "Give me five tips for a job interview, as a numbered list.",
    "Summarize the causes of the First World War in one paragraph.",
    "Translate 'the weather is nice today' into Spanish and German.",
    "Explain what a hash table is to a beginner programmer.",
    "Write a short, friendly email inviting my team to a Friday lunch.",
)
REPLY_TOKENS = 48


def calibration_ids(tokenizer) -> list[list[int]]:
    """The calibration prompts as the model sees them: its chat template where it has one."""
    out = []
    for text in CALIBRATION:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(list(ids))
    return out


# The linear layers smoothed, by the module whose input the maxima are taken at: q_proj stands for
# q/k/v (one input), gate_proj for gate/up, down_proj for itself.
SMOOTHED = ("q_proj", "gate_proj", "down_proj")


@torch.no_grad()
def activation_maxima(cfg: ModelConfig, state: dict[str, np.ndarray], prompts: list[list[int]],
                      reply_tokens: int = REPLY_TOKENS) -> dict[str, np.ndarray]:
    """Per-channel max |input| of every layer's SMOOTHED modules over the prompts and the model's
    greedy replies to them (what decoding feeds the layers), keyed "layer.module"."""
    model = CausalLM(cfg, n_positions=max(map(len, prompts)) + reply_tokens)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    maxima: dict[str, torch.Tensor] = {}

    def record(key):
        def hook(_, args):
            m = args[0].abs().flatten(0, -2).amax(0)
            maxima[key] = torch.maximum(maxima[key], m) if key in maxima else m
        return hook

    for i, layer in enumerate(model.model.layers):
        for name in SMOOTHED:
            module = getattr(layer.mlp if name != "q_proj" else layer.self_attn, name)
            module.register_forward_pre_hook(record(f"{i}.{name}"))
    for ids in tqdm(prompts, desc="SmoothQuant calibration", unit="prompt", file=sys.stderr):
        cache = KVCache(cfg, len(ids) + reply_tokens)
        x, start = torch.tensor([ids]), 0
        for _ in range(reply_tokens):
            t = x.shape[1]
            logits, _ = model(x, torch.arange(start, start + t)[None], causal_bias(t, start), cache, start)
            start += t
            x = logits[:, -1:].argmax(-1)
    return {k: v.numpy() for k, v in maxima.items()}


def smoothing_factors(x_max: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """s_j = max|x_j|^alpha / max|W_:j|^(1 - alpha) over the weights [N, K] sharing input channel j."""
    w_max = np.max([np.abs(w).max(0) for w in weights], axis=0)
    s = np.power(np.maximum(x_max, 1e-5), alpha) / np.power(np.maximum(w_max, 1e-5), 1 - alpha)
    return np.clip(s, 1e-5, 1e5).astype(np.float32)


def smooth(cfg: ModelConfig, state: dict[str, np.ndarray], maxima: dict[str, np.ndarray],
           alpha: float = ALPHA) -> dict[str, np.ndarray]:
    """A copy of `state` with the smoothing folded in: the same function in exact arithmetic."""
    out = dict(state)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        # (the module the maxima were taken at, the weights reading that input, what writes it)
        for key, weights, source in ((f"{i}.q_proj", [f"{p}self_attn.{n}_proj.weight" for n in "qkv"],
                                      f"{p}input_layernorm.weight"),
                                     (f"{i}.gate_proj", [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"],
                                      f"{p}post_attention_layernorm.weight"),
                                     (f"{i}.down_proj", [f"{p}mlp.down_proj.weight"], f"{p}mlp.up_proj.weight")):
            s = smoothing_factors(maxima[key], [out[w] for w in weights], alpha)
            for w in weights:
                out[w] = out[w] * s
            # a norm weight [K] scales channels; up_proj [K, H] writes channel j with its row j
            out[source] = out[source] / (s if out[source].ndim == 1 else s[:, None])
    return out
