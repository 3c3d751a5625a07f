"""EAGLE-2 speculative decoding algorithms, backend-free (numpy only)."""
from .sampling import process_logits, sample
from .tree import DraftPool, DraftTree, tree_from_parents, write_attention_bias
from .verify import accept_greedy, accept_sampling

__all__ = [
    "DraftPool",
    "DraftTree",
    "accept_greedy",
    "accept_sampling",
    "process_logits",
    "sample",
    "tree_from_parents",
    "write_attention_bias",
]
