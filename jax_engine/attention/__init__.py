"""Attention backends: one module per kernel family, chosen by platform (DESIGN.md §5).

  reference   pure JAX (per-token gather through the page table, masked softmax); the fallback anywhere
  cpu         the reference's layout, a C++ per-token kernel (jax_engine/kernels/cpu.cc)
  pallas_gpu  jax.experimental.pallas.ops.gpu.paged_attention with every token its own sequence;
              with a sliding window that bites, an own Pallas kernel over each token's window pages
  pallas_tpu  jax.experimental.pallas.ops.tpu.ragged_paged_attention

A backend owns its KV-cache layout, so it owns everything that touches the cache: its shape and
sharding (`cache_specs`), the KV write, the attention itself and the copy-on-write page copy.
Interface (duck-typed), over one ragged step's flat token list (llama.StepInputs): `name`,
`page_buckets` (True when the attention cost grows with the page table's width, so the runner
buckets it; False when the kernel reads only the pages it needs), `unsupported(cfg, page_size,
dtype)` (None or why not), `cache_specs(cfg, num_pages, page_size)` ({"k"|"v": (shape,
PartitionSpec)}), `prepare(cfg, inp, page_size)` (per-step metadata, outside the layer scan),
`write(kc, vc, layer, k, v, meta)` (k, v [T, KVH, D]), `attend(q, kc, vc, layer, meta)` (q [T, KVH,
G, D] -> same shape; token t sees its row's keys at positions < kv_limit[t] and inside the sliding
window; padding tokens' outputs are discarded) and `copy_page(cfg, kc, vc, src, dst, page_size)`.
`LlamaConfig.attention_backend` names it (default `reference`; GenerateWorker sets it from
`--attention-backend` through `resolve()`); the runner and the decoder module (models/decoder.py) both ask `get()`.

`--attention-backend` (EngineArgs.attention_backend): `auto` = TPU -> pallas_tpu, GPU ->
pallas_gpu, CPU -> cpu (tp 1 and the kernels built; else reference); `reference` forces the
reference anywhere; `pallas` forces the platform's kernel and fails at start-up on CPU
(interpret mode is for the tests only, far too slow to serve) or where the kernel does not
support the model's shapes. The Pallas kernels are not
wrapped in shard_map yet, so with tensor parallelism (tp > 1) `auto` picks the reference and
`pallas` is refused: a kernel custom call inside a GSPMD-partitioned program would gather the
whole KV cache onto every device.

Names `get()` accepts beyond those: `cpu`, `pallas_gpu`, `pallas_tpu`, and any of them with
`:interpret` (Pallas interpret mode; tests run the kernels on CPU this way).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from jax_engine.errors import InvalidRequest

log = logging.getLogger("xlaserve.attention")

CHOICES = ("auto", "reference", "pallas")


def _platform() -> str:
    from jax_engine.executor import backend  # the one place that names the platform (tests patch it)

    return backend.platform()


def _by_platform(plat: str) -> str:
    return {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu", "tpu": "pallas_tpu",
            "cpu": "cpu"}.get(plat, "reference")


def resolve(choice: Optional[str], cfg: Any, page_size: int, dtype: Any, tp: int = 1,
            platform: Optional[str] = None, ep: int = 1) -> str:
    """The concrete backend for an `--attention-backend` choice on this platform (start-up check).
    tp and ep: the replica's tensor- and expert-parallel sizes (a replica spans tp x ep devices)."""
    choice = choice or "auto"
    if choice not in CHOICES:
        raise InvalidRequest(f"attention backend {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "reference":
        return "reference"
    plat = platform or _platform()
    name = _by_platform(plat)
    why = None
    if choice == "pallas" and name in ("reference", "cpu"):
        why = f"no Pallas attention kernel for platform {plat!r} (Pallas interpret mode is for tests only)"
    elif name == "reference":
        why = f"no attention kernel for platform {plat!r}"
    elif tp * ep > 1:
        why = (f"the attention kernels are not sharded for tensor parallelism yet (tp {tp})" if ep == 1 else
               f"the attention kernels are not sharded over a replica's devices yet (tp {tp} x ep {ep})")
    elif name != "cpu" and (getattr(cfg, "attn_softcap", 0.0) or getattr(cfg, "layer_windows", ())):
        why = "the Pallas kernels have no attention soft-capping or per-layer windows (Gemma)"
    else:
        why = get(name).unsupported(cfg, page_size, dtype)
    if why is None:
        log.info("attention backend: %s (%s on %s)", name, choice, plat)
        return name
    if choice == "pallas":
        raise InvalidRequest(f"--attention-backend pallas: {why}; use auto or reference")
    log.info("attention backend: reference (auto on %s: %s)", plat, why)
    return "reference"


_CACHE: dict[str, Any] = {}


def get(name: Optional[str]) -> Any:
    """The backend object for a concrete name (`auto` resolves by platform only)."""
    base, _, mode = (name or "auto").partition(":")
    if mode not in ("", "interpret"):
        raise InvalidRequest(f"attention backend {name!r}: unknown mode {mode!r}")
    if base in ("auto", "pallas"):
        plat = _platform()
        base = _by_platform(plat)
        if base == "cpu" and name.startswith("pallas"):
            raise InvalidRequest(f"attention backend 'pallas' needs a GPU or TPU, not {plat!r}")
        if base == "cpu":
            from jax_engine.kernels import cpu as cpu_kernels
            base = "cpu" if cpu_kernels.available() else "reference"
    key = f"{base}:{mode}"
    if key not in _CACHE:
        interpret = mode == "interpret"
        if base == "reference":
            from jax_engine.attention.reference import Reference
            be = Reference()
        elif base == "cpu":
            from jax_engine.attention.cpu import CpuKernel
            be = CpuKernel()
        elif base == "pallas_gpu":
            from jax_engine.attention.pallas_gpu import PallasGPU
            be = PallasGPU(interpret=interpret)
        elif base == "pallas_tpu":
            from jax_engine.attention.pallas_tpu import PallasTPU
            be = PallasTPU(interpret=interpret)
        else:
            raise InvalidRequest(f"attention backend {name!r} is not known (reference, cpu, pallas_gpu, pallas_tpu)")
        _CACHE[key] = be
    return _CACHE[key]
