"""A graph's interface as its manifest entry lists it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64}


@dataclass(frozen=True)
class GraphSpec:
    """The step's own inputs and outputs apart from its caches (past_* inputs [1, heads, length,
    width], written in place as present_*)."""
    inputs: list[str]                  # in the graph's order, as are outputs
    outputs: list[str]
    shapes: dict[str, list]            # of inputs and outputs by name; "T", "R", "k" are a step's sizes
    dtypes: dict[str, type]
    cache_names: list[str]
    cache_dims: list[tuple[int, int]]  # (heads, width) of each cache
    cache_dtype: type

    @classmethod
    def parse(cls, spec: dict) -> GraphSpec:
        past = [i for i in spec["inputs"] if i["name"].startswith("past_")]
        own = [i for i in spec["inputs"] + spec["outputs"] if not i["name"].startswith(("past_", "present_"))]
        return cls(inputs=[i["name"] for i in spec["inputs"] if i not in past],
                   outputs=[o["name"] for o in spec["outputs"] if not o["name"].startswith("present_")],
                   shapes={i["name"]: i["shape"] for i in own}, dtypes={i["name"]: NP_DTYPES[i["dtype"]] for i in own},
                   cache_names=[i["name"] for i in past], cache_dims=[(i["shape"][1], i["shape"][3]) for i in past],
                   cache_dtype=NP_DTYPES[past[0]["dtype"]])

    @property
    def slotted(self) -> bool:
        """Whether the graph holds the caches of several sequences and writes each row at its own
        sequence's slot (input cache_slots; export/onnx_graph.py)."""
        return "cache_slots" in self.inputs
