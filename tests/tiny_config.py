"""The tiny model and batch shared by the TOML configs of tests and benchmarks (a step takes
milliseconds on one core). Callers append the rest of ``[train]`` and any further tables."""

TINY_TOML = """[model]
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
vocab_size = 320

[train]
seq_len = 32
global_batch_size = 8
micro_batch_size = 2
"""
