"""SmoothQuant (arXiv 2211.10438) for the precisions whose products quantize activations to 8 bits.

w8a8 quantizes each activation row with one scale (export/onnx_graph.py: Builder._w8a8_linear), and
int8's MatMulNBits at accuracy level 4 each block of 32 input channels of a row, so a few large
channels set the scale of a whole row (or block) and flatten every other channel's resolution.
SmoothQuant moves that range into the weights: channel j of a linear layer's input is divided by
s_j and the layer's weight column j multiplied by it, which leaves the product unchanged in exact
arithmetic. The division is folded into whatever writes the input, so it costs nothing at run time:
the RMSNorm weight before q/k/v and before gate/up, and up_proj's rows before down_proj (its input
is silu(gate) * up, linear in up). s_j = max|x_j|^alpha / max|W_:j|^(1 - alpha), from the model's
own activations on a fixed calibration set (chat prompts with fixed replies, teacher-forced).

Smoothing q/k/v, gate/up and down_proj raises w8a8's agreement with fp32 towards int8's, and alpha
0.5 did best (docs/code-notes.md); it also raises int8's, on held-out chats (docs/design.md,
"Precisions"). o_proj's input (the attention output) and lm_head's (the final norm's, which is also
the draft head's feature) are left as they are: row-quantizing either alone lost little.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np
import torch
from tqdm import tqdm

from models.config import ModelConfig
from models.llama import CausalLM, KVCache, causal_bias, forward_layers
from models.tensors import LazyTensors, layer_tensors

ALPHA = 0.5
# The ONNX precisions whose weights are smoothed at export.
SMOOTHED_PRECISIONS = ("int8", "w8a8", "w8a16")
# Varied on purpose (chat, code, arithmetic, a list, prose, translation): the maxima should see
# every kind of text. Each prompt comes with a fixed reply, so that calibration is one
# teacher-forced pass that runs a layer at a time (forward_layers), whatever the model's size;
# greedy replies would need the whole model per generated token.
CALIBRATION = (
    ("What is the capital of France, and why did it become the capital?",
     "The capital of France is Paris. It became the capital because the Capetian kings ruled from it in the "
     "tenth century: it sat on the Seine at the centre of their lands, close to rich farmland and trade routes, "
     "and the royal court, the church and later the government all grew around it."),
    ("Write a Python function that returns the n-th Fibonacci number, with a docstring and a test.",
     "```python\ndef fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number (fibonacci(0) == 0).\"\"\"\n"
     "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
     "def test_fibonacci():\n    assert [fibonacci(i) for i in range(7)] == [0, 1, 1, 2, 3, 5, 8]\n```"),
    ("A train leaves at 3:40 pm and travels 150 km at 60 km/h. When does it arrive? Show your steps.",
     "1. Time = distance / speed = 150 km / 60 km/h = 2.5 hours.\n2. 2.5 hours is 2 hours and 30 minutes.\n"
     "3. 3:40 pm + 2 h = 5:40 pm; 5:40 pm + 30 min = 6:10 pm.\nThe train arrives at 6:10 pm."),
    ("Give me five tips for a job interview, as a numbered list.",
     "1. Research the company and the role before you go.\n2. Prepare short stories that show your skills.\n"
     "3. Arrive ten minutes early and dress a little above the office norm.\n4. Listen carefully and answer "
     "the question that was asked.\n5. Ask two or three thoughtful questions at the end, and send a thank-you note."),
    ("Summarize the causes of the First World War in one paragraph.",
     "The First World War grew out of militarism, a web of alliances, imperial rivalry and nationalism. The "
     "great powers had built up large armies and navies, and treaties bound them to defend each other, so when "
     "a Serbian nationalist assassinated Archduke Franz Ferdinand in Sarajevo in June 1914, Austria-Hungary's "
     "ultimatum to Serbia drew Russia, Germany, France and Britain into war within weeks."),
    ("Translate 'the weather is nice today' into Spanish and German.",
     "Spanish: \"Hoy hace buen tiempo.\"\nGerman: \"Das Wetter ist heute schön.\""),
    ("Explain what a hash table is to a beginner programmer.",
     "A hash table stores values under keys, like a dictionary. A hash function turns each key into a number "
     "that picks a slot in an array, so finding a value takes about the same time however many items there are. "
     "When two keys land in the same slot, the table keeps both, for example in a short list."),
    ("Write a short, friendly email inviting my team to a Friday lunch.",
     "Subject: Team lunch this Friday!\n\nHi everyone,\n\nLet's celebrate a great week together: lunch is on "
     "Friday at 12:30 at Luigi's, just around the corner. Please reply by Wednesday so I can book a table, and "
     "tell me about any dietary needs.\n\nSee you there,\nAlex"),
)


def calibration_ids(tokenizer, replies: bool) -> list[list[int]]:
    """The calibration prompts as the model sees them (its chat template where it has one), with
    their fixed replies or ready for the model's own."""
    out = []
    for prompt, reply in CALIBRATION:
        turns = [{"role": "user", "content": prompt}] + ([{"role": "assistant", "content": reply}] if replies else [])
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(turns, add_generation_prompt=not replies, tokenize=True,
                                                return_dict=True)["input_ids"]
        else:
            ids = tokenizer(f"{prompt}\n{reply}" if replies else prompt)["input_ids"]
        out.append(list(ids))
    return out


# The linear layers smoothed, by the module whose input the maxima are taken at: q_proj stands for
# q/k/v (one input), gate_proj for gate/up, down_proj for itself.
SMOOTHED = ("q_proj", "gate_proj", "down_proj")
# Tokens of the model's own greedy reply to each prompt (resident calibration).
REPLY_TOKENS = 48


def resident_model(cfg: ModelConfig, state: Mapping, n_positions: int) -> CausalLM:
    """The whole model in fp32, its weights taken from `state` without a random initialisation first."""
    with torch.device("meta"):
        model = CausalLM(cfg, n_positions=n_positions).eval()
    model.load_state_dict({k: torch.as_tensor(state[k]).float() for k in state}, strict=False, assign=True)
    if cfg.tie_word_embeddings:  # assign replaced the embedding the lm_head was tied to
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


@torch.no_grad()
def greedy_reply(model: CausalLM, cfg: ModelConfig, ids: list[int], n: int, stop: frozenset[int] = frozenset()) -> list[int]:
    """The model's greedy continuation of `ids`: n tokens, or up to and including a `stop` token."""
    cache = KVCache(cfg, len(ids) + n)
    x, start, reply = torch.tensor([ids]), 0, []
    while len(reply) < n and not (reply and reply[-1] in stop):
        t = x.shape[1]
        logits, _ = model(x, torch.arange(start, start + t)[None], causal_bias(t, start), cache, start)
        start += t
        x = logits[:, -1:].argmax(-1)
        reply.append(int(x))
    return reply


class _Maxima:
    """Per-channel max |input| of the SMOOTHED modules, recorded by forward pre-hooks."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}

    def watch(self, i: int, layer) -> None:
        for name in SMOOTHED:
            module = getattr(layer.mlp if name != "q_proj" else layer.self_attn, name)
            module.register_forward_pre_hook(self._record(f"{i}.{name}"))

    def _record(self, key):
        def hook(_, args):
            m = args[0].abs().flatten(0, -2).amax(0)
            self.values[key] = torch.maximum(self.values[key], m) if key in self.values else m
        return hook

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in self.values.items()}


@torch.no_grad()
def activation_maxima(cfg: ModelConfig, state: Mapping[str, np.ndarray], tokenizer,
                      resident: bool) -> tuple[dict[str, np.ndarray], str]:
    """Per-channel max |input| of every layer's SMOOTHED modules, keyed "layer.module", and what
    they were taken on.

    `resident`: the whole fp32 model in memory, over the prompts and the model's own greedy replies
    (what decoding feeds the layers). Otherwise a layer at a time (models.llama.forward_layers),
    over the prompts with fixed replies, teacher-forced: a greedy reply would cost a pass over
    every weight per token. The resident form calibrates small models better (docs/large-models.md),
    so the exporter takes it where the fp32 model fits in its memory estimate anyway."""
    maxima = _Maxima()
    if resident:
        prompts = calibration_ids(tokenizer, replies=False)
        model = resident_model(cfg, state, max(map(len, prompts)) + REPLY_TOKENS)
        for i, layer in enumerate(model.model.layers):
            maxima.watch(i, layer)
        for ids in tqdm(prompts, desc="SmoothQuant calibration", unit="prompt", file=sys.stderr):
            greedy_reply(model, cfg, ids, REPLY_TOKENS)
        return maxima.arrays(), f"{len(CALIBRATION)} built-in chat prompts and the model's greedy replies " \
                                f"({REPLY_TOKENS} tokens each)"
    sequences = calibration_ids(tokenizer, replies=True)
    embed = torch.as_tensor(state["model.embed_tokens.weight"])
    xs = [[embed[torch.tensor([ids])]] for ids in sequences]
    del embed
    steps = [[(torch.arange(len(ids))[None], causal_bias(len(ids)), 0)] for ids in sequences]
    with tqdm(total=cfg.num_layers, desc="SmoothQuant calibration", unit="layer", file=sys.stderr) as bar:
        def visit(i, layer, _xs, _caches):
            maxima.watch(i, layer)
            bar.update(1)
        forward_layers(cfg, lambda i: layer_tensors(state, f"model.layers.{i}."), xs, steps,
                       max(map(len, sequences)), visit)
    return maxima.arrays(), f"{len(CALIBRATION)} built-in chat prompts with fixed replies, teacher-forced, a layer " \
                            "at a time"


def smoothing_factors(x_max: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """s_j = max|x_j|^alpha / max|W_:j|^(1 - alpha) over the weights [N, K] sharing input channel j."""
    w_max = np.max([np.abs(w).max(0) for w in weights], axis=0)
    s = np.power(np.maximum(x_max, 1e-5), alpha) / np.power(np.maximum(w_max, 1e-5), 1 - alpha)
    return np.clip(s, 1e-5, 1e5).astype(np.float32)


def smooth(cfg: ModelConfig, state: Mapping[str, np.ndarray], maxima: dict[str, np.ndarray],
           alpha: float = ALPHA) -> LazyTensors:
    """`state` with the smoothing folded in (the same function in exact arithmetic), computed per
    tensor on access: the factors are taken from the unsmoothed weights once, here."""
    factors, scaled, divided = {}, {}, {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        # (the module the maxima were taken at, the weights reading that input, what writes it)
        for key, weights, source in ((f"{i}.q_proj", [f"{p}self_attn.{n}_proj.weight" for n in "qkv"],
                                      f"{p}input_layernorm.weight"),
                                     (f"{i}.gate_proj", [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"],
                                      f"{p}post_attention_layernorm.weight"),
                                     (f"{i}.down_proj", [f"{p}mlp.down_proj.weight"], f"{p}mlp.up_proj.weight")):
            factors[key] = smoothing_factors(maxima[key], [state[w] for w in weights], alpha)
            for w in weights:
                scaled[w] = key
            divided[source] = key

    def load(name):
        w = state[name]
        if name in scaled:
            w = w * factors[scaled[name]]
        if name in divided:
            # a norm weight [K] scales channels; up_proj [K, H] writes channel j with its row j
            s = factors[divided[name]]
            w = w / (s if w.ndim == 1 else s[:, None])
        return w
    return LazyTensors(state.keys(), load)
