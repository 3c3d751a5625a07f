"""EAGLE-2 runtime over ONNX Runtime: `gen = runtime.load(artifact); gen.generate(prompt)`."""
from .api import GenerationOutput, Generator, load
from .session import openvino_options

__all__ = ["GenerationOutput", "Generator", "load", "openvino_options"]
