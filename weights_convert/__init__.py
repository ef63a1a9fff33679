"""The offline checkpoint converter (`xlaserve convert`, `python -m weights_convert`): a client of
the engine's checkpoint package (jax_engine/checkpoint/), which it never extends."""
