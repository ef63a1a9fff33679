"""The device side of multi-LoRA: S adapter slots padded to rank R, and the step's LoRA term.

Layout: every array of jax_engine/lora/adapter.py with a slot axis after the layer axis,
[L, S, ...], so a scan over layers hands each layer its [S, ...] slice and loading an adapter is
one `.at[:, slot].set(...)` per array (a program compiled once, at warmup: a load compiles
nothing). Under tensor parallelism the A of a row-parallel matrix (o, down) is sharded over its
input like the base weight and its B replicated; the A of a column-parallel matrix (qkv,
gate_up) is replicated and its B sharded over the output: XLA adds the one all-reduce the
row-parallel base matmul already has.

The LoRA term is computed for all S slots at once, masked per token by its slot (the "stacked"
form): xa = x @ A_all [T, S, R] * onehot(slot), y = xa @ B_all. The alternative, gathering each
token's own A and B ([T, H, R] per matrix), was measured slower on CPU
(benchmarks/lora_decode.py, README): the stacked form is two dense GEMMs that read each slot's
weights once per step, the gathered one copies T slices of them. A step with no LoRA row skips
the term (`lax.cond`), so base-model traffic pays one predicate per layer.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_engine.lora.adapter import ARRAYS, array_shapes  # noqa: F401  (array_shapes: the runner's warmup)
from jax_engine.models.llama import LlamaConfig

Bank = dict[str, jax.Array]

# the axis of each bank array ([L, S, ...]) sharded over the mesh's "model" axis, as its base weight is
_TP_AXIS = {"qkv_b": 3, "o_a": 2, "gu_b": 4, "down_a": 2}


def bank_shapes(cfg: LlamaConfig, slots: int, rank: int) -> dict[str, tuple[int, ...]]:
    return {k: (s[0], slots) + s[1:] for k, s in array_shapes(cfg, rank).items()}


def bank_sharding(name: str, ndim: int, mesh: Optional[Mesh]) -> Any:
    if mesh is None:
        return jax.local_devices()[0]
    spec = [None] * ndim
    if name in _TP_AXIS:
        spec[_TP_AXIS[name]] = "model"
    return NamedSharding(mesh, P(*spec))


def new_bank(cfg: LlamaConfig, slots: int, rank: int, dtype: Any, mesh: Optional[Mesh]) -> Bank:
    """All slots zero (an empty slot adds nothing)."""
    return {k: jnp.zeros(s, dtype, device=bank_sharding(k, len(s), mesh))
            for k, s in bank_shapes(cfg, slots, rank).items()}


def write_slot(bank: Bank, slot: jax.Array, arrays: Bank) -> Bank:
    """Bank with slot `slot` (0-based) replaced by `arrays` (one slot's [L, ...] arrays)."""
    return {k: bank[k].at[:, slot].set(arrays[k].astype(bank[k].dtype)) for k in ARRAYS}


def host_slot(arrays: dict[str, np.ndarray], mesh: Optional[Mesh]) -> Bank:
    """One adapter's arrays on device with the bank's shardings minus the slot axis."""
    out = {}
    for k in ARRAYS:
        a = arrays[k]
        if mesh is None:
            out[k] = jax.device_put(a, jax.local_devices()[0])
            continue
        spec = [None] * a.ndim
        if k in _TP_AXIS:
            spec[_TP_AXIS[k] - 1] = "model"
        out[k] = jax.device_put(a, NamedSharding(mesh, P(*spec)))
    return out
