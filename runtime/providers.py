"""Which backend (runtime/backend.py) runs a provider: ONNX Runtime's for cpu, cuda and openvino,
torch's for ipex and torch. The one place that tells them apart."""
from __future__ import annotations

from pathlib import Path

from .backend import Session
from .session import GraphSession, check_provider as check_onnx_provider
from .torch_session import TORCH_PROVIDERS, TorchSession


def backend(provider: str) -> type[GraphSession] | type[TorchSession]:
    return TorchSession if provider in TORCH_PROVIDERS else GraphSession


def check_provider(provider: str) -> None:
    """Refuse an unknown or uninstalled ONNX Runtime provider before anything loads; torch's are
    checked when their session imports torch."""
    if backend(provider) is GraphSession:
        check_onnx_provider(provider)


def check_target(manifest: dict, provider: str) -> None:
    """Whether the provider's backend runs this artifact, here."""
    backend(provider).check_artifact(manifest, provider)


def open_session(root: Path, spec: dict, provider: str, device: str, cache_length: int, steps: int, max_k: int,
                 threads: int | None, provider_options: dict | None = None, sequences: int = 1) -> Session:
    """One graph of the artifact at `root` (its manifest's graphs[...] entry `spec`) on the provider's backend;
    `device` places torch sessions (ONNX Runtime's providers choose their own); caches for `sequences`
    sequences (more than one: slotted graphs only)."""
    return backend(provider).open(str(root / spec["file"]), spec, provider, device, cache_length, steps, max_k,
                                  threads, provider_options, sequences)
