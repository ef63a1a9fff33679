"""The device side of multi-LoRA: S adapter slots padded to rank R, in device arrays.

Layout: every array of jax_engine/lora/adapter.py with a slot axis S next to its rank axis, so one
layer's slice reshapes for free into the 2-D GEMM operands of jax_engine/models/lora.py: an A
[L, in..., S, R] -> [in, S*R]; a B [L, S, R, out...] -> [S*R, out]. Loading an adapter is one
`.at[...].set` per array along its slot axis (`lora_write`, compiled once at warmup, so a load
compiles nothing). Under tensor parallelism the A of a row-parallel matrix (o, down) is sharded
over its input like the base weight and its B replicated; the A of a column-parallel matrix (qkv,
gate_up) is replicated and its B sharded over the output: XLA adds the one all-reduce the
row-parallel base matmul already has.
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

# the axis of each one-slot array (adapter.py layout, [L, ...]) sharded over the mesh's "model" axis,
# as its base weight is: the KV heads of q/k/v_b and o_a, the intermediate dim of gate/up_b and down_a
_TP_AXIS = {"q_b": 2, "k_b": 2, "v_b": 2, "o_a": 1, "gate_b": 2, "up_b": 2, "down_a": 1}


def slot_axis(name: str, ndim: int) -> int:
    """Where the slot axis sits in bank array `name` (ndim = the one-slot array's rank): before
    the rank axis, which is last for an A and second for a B."""
    return ndim - 1 if name.endswith("_a") else 1


def _bank_axis(name: str, ndim: int, axis: int) -> int:
    """Axis `axis` of a one-slot array, counted in the bank array (which has the slot axis too)."""
    return axis + (1 if axis >= slot_axis(name, ndim) else 0)


def bank_shapes(cfg: LlamaConfig, slots: int, rank: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for k, s in array_shapes(cfg, rank).items():
        i = slot_axis(k, len(s))
        out[k] = s[:i] + (slots,) + s[i:]
    return out


def bank_sharding(name: str, ndim: int, mesh: Optional[Mesh]) -> Any:
    """Sharding of bank array `name` of rank `ndim` (slot axis included)."""
    if mesh is None:
        return jax.local_devices()[0]
    spec = [None] * ndim
    if name in _TP_AXIS:
        spec[_bank_axis(name, ndim - 1, _TP_AXIS[name])] = "model"
    return NamedSharding(mesh, P(*spec))


def new_bank(cfg: LlamaConfig, slots: int, rank: int, dtype: Any, mesh: Optional[Mesh]) -> Bank:
    """All slots zero (an empty slot adds nothing)."""
    return {k: jnp.zeros(s, dtype, device=bank_sharding(k, len(s), mesh))
            for k, s in bank_shapes(cfg, slots, rank).items()}


def write_slot(bank: Bank, slot: jax.Array, arrays: Bank) -> Bank:
    """Bank with slot `slot` (0-based) replaced by `arrays` (one slot's [L, ...] arrays)."""
    out = {}
    for k in ARRAYS:
        axis = slot_axis(k, arrays[k].ndim)
        new = jnp.expand_dims(arrays[k].astype(bank[k].dtype), axis)
        out[k] = jax.lax.dynamic_update_slice_in_dim(bank[k], new, slot, axis)
    return out


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
            spec[_TP_AXIS[k]] = "model"
        out[k] = jax.device_put(a, NamedSharding(mesh, P(*spec)))
    return out
