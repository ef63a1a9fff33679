"""One `lax.scan` over a module's stacked layers, for the decoder and the encoders alike.

A layers module holds every parameter with a leading layer axis ([L, ...]). The scan slices
most of them per layer, but some are handed over whole and indexed by the layer inside their
consumer: the CPU kernel's packed panels (the custom call takes the layer index) and, in the
decoder, library-sgemm weights and MoE experts. Slicing those would copy a layer's worth per
step (73 vs 3.2 ms per MoE layer at one token, decoder.py). Each model passes its own filter.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx


def scan(layers: nnx.Module, keep_whole: Callable[[str], bool], length: int, body: Callable, init: Any,
         extra: Any = None) -> Any:
    """lax.scan of body(carry, layer, extra_slice) -> carry over `length` stacked layers: `layer`
    is `layers` merged from this layer's slice of every parameter whose dotted path
    `keep_whole` rejects and the whole of those it accepts; `extra` (a pytree with a leading
    layer axis, or None) is sliced along with it. Returns the final carry."""
    gd, whole, sliced = nnx.split(layers, lambda p, _: keep_whole(".".join(map(str, p))), ...)

    def step(carry, xs):
        state_l, ex = xs
        return body(carry, nnx.merge(gd, whole, state_l), ex), None

    return jax.lax.scan(step, init, (sliced, extra), length=length)[0]
