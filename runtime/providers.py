"""Which backend (runtime/backend.py) runs a provider: ONNX Runtime's for cpu, cuda and openvino,
torch's for ipex and torch. The one place that tells them apart."""
from __future__ import annotations

from pathlib import Path

from .backend import Backend, ProviderError, Session
from .session import GraphSession
from .torch_session import TorchSession

BACKENDS: tuple[type[Backend], ...] = (GraphSession, TorchSession)


def backend(provider: str) -> type[Backend]:
    for b in BACKENDS:
        if provider in b.providers:
            return b
    known = [p for b in BACKENDS for p in b.providers]
    raise ProviderError(f"unknown provider {provider!r}; choose one of {', '.join(known[:3])} (ONNX artifacts), "
                        f"or {' / '.join(known[3:])} for torch artifacts")


def check_provider(provider: str) -> None:
    backend(provider).check_provider(provider)


def check_target(manifest: dict, provider: str) -> None:
    """Whether the provider's backend runs this artifact, here."""
    b = backend(provider)
    b.check_provider(provider)
    b.check_artifact(manifest, provider)


def can_batch(manifest: dict, provider: str) -> bool:
    """Whether the artifact decodes sequences side by side on this provider (runtime/batch.py)."""
    check_target(manifest, provider)
    return backend(provider).batches(manifest)


def target_provider(target: str, onnx_provider: str = "cpu") -> str:
    """The provider that runs an artifact exported for `target`: an ONNX artifact the ONNX Runtime
    provider given, a torch one (torch, ipex) its own target's."""
    return onnx_provider if target == "onnx" else target


def open_session(root: Path, spec: dict, provider: str, device: str, cache_length: int, steps: int, max_k: int,
                 threads: int | None, provider_options: dict | None = None, sequences: int = 1) -> Session:
    """One graph of the artifact at `root` (its manifest's graphs[...] entry `spec`) on the provider's backend;
    `device` places torch sessions (ONNX Runtime's providers choose their own); caches for `sequences`
    sequences (more than one: slotted graphs only)."""
    return backend(provider).open(str(root / spec["file"]), spec, provider, device, cache_length, steps, max_k,
                                  threads, provider_options, sequences)
