"""The Llama-style transformer, parameter and FLOP counting."""

from relaytrain.model.flops import count_parameters, flops_per_token, matmul_parameters
from relaytrain.model.transformer import Transformer, TransformerBlock, ffn_hidden_dim

__all__ = [
    "Transformer",
    "TransformerBlock",
    "count_parameters",
    "ffn_hidden_dim",
    "flops_per_token",
    "matmul_parameters",
]
