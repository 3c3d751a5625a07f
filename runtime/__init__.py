"""EAGLE-2 runtime over ONNX Runtime: `gen = runtime.load(artifact); gen.generate(prompt)`."""
from .api import GenerationOutput, Generator, load

__all__ = ["GenerationOutput", "Generator", "load"]
