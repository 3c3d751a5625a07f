"""EAGLE-2 speculative decoding algorithms, backend-free (numpy only)."""
from .lookup import NgramIndex
from .sampling import process_logits, sample, token_logprobs
from .sizing import Pace, best_tree_size, expected_tokens
from .tree import DraftPool, DraftTree, graft_chain, share_rows, tree_from_parents, write_attention_bias
from .verify import accept_greedy, accept_sampling

__all__ = [
    "DraftPool",
    "DraftTree",
    "NgramIndex",
    "Pace",
    "accept_greedy",
    "accept_sampling",
    "best_tree_size",
    "expected_tokens",
    "graft_chain",
    "process_logits",
    "sample",
    "share_rows",
    "token_logprobs",
    "tree_from_parents",
    "write_attention_bias",
]
