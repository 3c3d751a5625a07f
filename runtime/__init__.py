"""EAGLE-2 runtime over ONNX Runtime: `gen = runtime.load(artifact); gen.generate(prompt)`.

open_session opens one graph of an artifact on a provider's backend (runtime/backend.py), for code
that steps a graph itself, such as the exporter's parity check."""
from .api import Event, GenerationOutput, Generator, TokenLogprob, load
from .backend import ProviderError
from .providers import open_session, target_provider
from .session import openvino_options

__all__ = ["Event", "GenerationOutput", "Generator", "ProviderError", "TokenLogprob", "load", "open_session",
           "openvino_options", "target_provider"]
