"""Logits of every prompt position through the serving forward pass, for parity checks.

The serving programs return only each row's last logits; comparing against transformers needs
all of them. This runs the decoder module over a fresh set of pages (1..P) of a copy of the
runner's KV layout, so it leaves the served state untouched. Used by the tests and by
benchmarks/device_check.py; not on any serving path (it compiles on first use).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.models import decoder
from jax_engine.models.llama import StepInputs


def prompt_logits(runner, prompt: list[int], lora_slot: int = 0) -> np.ndarray:
    """[len(prompt), vocab] float32 logits of `prompt` through `runner`'s params and cache layout
    (under the LoRA adapter in 1-based bank slot `lora_slot`; 0 = the base model)."""
    ps = runner.rc.page_size
    T = len(prompt)
    P = math.ceil(T / ps)
    pages = np.arange(1, P + 1, dtype=np.int32)
    pos = np.arange(T, dtype=np.int32)
    slots = pages[pos // ps] * ps + pos % ps
    inp = StepInputs(jnp.array(prompt, jnp.int32), jnp.asarray(pos), jnp.asarray(slots), jnp.zeros(T, jnp.int32),
                     jnp.asarray(pos + 1), jnp.asarray(pages[None]), jnp.array([T], jnp.int32),
                     jnp.array([0, T], jnp.int32), jnp.array([1], jnp.int32))

    @jax.jit
    def f(params, k, v, inp, lora):
        model = decoder.merge(runner.graphdef, params)
        h, _, _ = model(k, v, inp, ps, lora)
        return model.logits(h)

    k = jnp.zeros_like(runner.state["k"])
    v = jnp.zeros_like(runner.state["v"])
    lora = None if runner.lora is None else (runner.lora, jnp.full(T, lora_slot, jnp.int32))
    return np.asarray(f(runner.params, k, v, inp, lora))
