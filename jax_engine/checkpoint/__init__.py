"""Checkpoints on disk, read by the engine: HF folders (`hf`), the converted fused format
(`converted`), and the one table of the decoder's fused weight layout both follow (`layout`).

The offline converter (`weights_convert/`) is a client of this package, never the reverse.
"""
from jax_engine.checkpoint.hf import CheckpointError, CheckpointReader, load_tokenizer, read_config

__all__ = ["CheckpointError", "CheckpointReader", "load_tokenizer", "read_config"]
