"""Random-weight checkpoints with real geometry, for scale work: memory, time and exactness.

    python -m models.random_checkpoint llama2-7b /data/llama2-7b-random

writes what a user would download: sharded bf16 `model-0000N-of-0000M.safetensors` with their
index, `config.json`, SmolLM2's tokenizer (from the embedded GGUF), and a random official-layout
EAGLE-1/2 head in `head/` (`config.json` with one layer and `bias`, `pytorch_model.bin`). Tensors
are generated and written one at a time, so making a 7B checkpoint needs little memory.
Random weights say nothing about quality or acceptance.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .config import ModelConfig
from .weights import base_tensor_shapes, head_tensor_shapes

SMOLLM2_VOCAB = 49152
# name -> (hidden, layers, ffn, heads, kv heads)
SHAPES = {
    "llama2-7b": (4096, 32, 11008, 32, 32),
    "tinyllama-1.1b": (2048, 22, 5632, 32, 4),
    "small-300m": (1024, 16, 2816, 16, 4),   # the memory-regression test's: large enough to see
}
SHARD_BYTES = 2 << 30
STD = 0.02


def shape_config(shape: str) -> ModelConfig:
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    hidden, layers, ffn, heads, kv = SHAPES[shape]
    return ModelConfig(model_type="llama", vocab_size=SMOLLM2_VOCAB, hidden_size=hidden, intermediate_size=ffn,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))


def random_tensor(name: str, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (STD * torch.randn(shape, generator=generator)).to(torch.bfloat16)


def write_base(cfg: ModelConfig, out: Path, seed: int) -> None:
    from safetensors.torch import save_file
    shapes = base_tensor_shapes(cfg)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = shape
        size += nbytes
    shards.append(current)
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    with tqdm(total=sum(2 * torch.Size(s).numel() for s in shapes.values()), desc="random weights", unit="B",
              unit_scale=True, file=sys.stderr) as bar:
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, shape in names.items():
                tensors[name] = random_tensor(name, shape, g)
                bar.update(tensors[name].nbytes)
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            total += sum(t.nbytes for t in tensors.values())
            weight_map.update(dict.fromkeys(names, file))
            del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps({**cfg.to_hf(), "torch_dtype": "bfloat16"}, indent=2))


def write_head(cfg: ModelConfig, out: Path, seed: int) -> None:
    """EAGLE-1/2's official layout: a one-layer Llama config with `bias`, fp16 weights in a .bin."""
    out.mkdir()
    head_cfg = ModelConfig(**{**cfg.to_dict(), "num_layers": 1})
    g = torch.Generator().manual_seed(seed + 1)
    state = {name: random_tensor(name, shape, g).half() for name, shape in head_tensor_shapes(head_cfg).items()}
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps({**head_cfg.to_hf(), "bias": True, "torch_dtype": "float16"},
                                                indent=2))


def write_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer
    from .registry import embedded_gguf
    gguf = embedded_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))


def make(shape: str, out: Path, seed: int = 0, head: bool = True) -> Path:
    cfg = shape_config(shape)
    out.mkdir(parents=True, exist_ok=False)
    write_tokenizer(out)
    write_base(cfg, out, seed)
    if head:
        write_head(cfg, out / "head", seed)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.random_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=SHAPES, help="geometry: " + ", ".join(
        f"{k} (hidden {v[0]}, {v[1]} layers, ffn {v[2]}, {v[3]}/{v[4]} heads)" for k, v in SHAPES.items()))
    p.add_argument("out", type=Path, help="directory to create")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-head", action="store_true", help="skip the random EAGLE-1/2 head")
    a = p.parse_args(argv)
    if a.out.exists():
        p.error(f"{a.out} exists")
    make(a.shape, a.out, a.seed, not a.no_head)
    print(f"wrote {a.out} (head: {a.out / 'head' if not a.no_head else 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
