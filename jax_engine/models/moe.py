"""The mixture-of-experts MLP of Mixtral and Qwen3-MoE: top-k routing, the expert FFN, and expert
(and tensor) parallelism.

Routing as transformers does it: softmax over the router logits (float32), the top k experts,
their weights renormalised to sum to 1 (Mixtral always, Qwen3-MoE when norm_topk_prob); each
token's output is the routing-weighted sum of its k experts' SwiGLU FFNs.
Weights (per layer): router [H, E]; experts_gate_up [E, H, 2, I]; experts_down [E, I, H]. With
--quantize int8 each expert matrix is {"q": int8, "s": float32 scale per expert and output channel}
([E, 2, I] and [E, H]): the sorted dispatch widens only the block's own expert to the activation
dtype inside its loop and scales the float32 accumulator, so an int8 step reads a quarter of the
float32 expert bytes; the ragged and dense formulations dequantise the layer's experts first.

The expert FFN has three formulations here (`METHODS`), measured by benchmarks/moe_dispatch.py:
  ragged  the T*k (token, expert) pairs sorted by expert, two `jax.lax.ragged_dot` grouped GEMMs.
          On CPU (and anywhere but TPU and GPU, which lower it to their own ragged-dot
          instruction / a Pallas kernel) XLA has no ragged-dot: JAX lowers it with
          `_ragged_dot_general_impl`, which masks the rows into an [E, T*k, H] operand and runs
          ONE dense dot contracting over the expert axis too, i.e. every expert multiplies every
          pair (E x the useful FLOPs, all E experts' weights read even for one token).
  sorted  a sort-by-expert dispatch: pairs sorted by expert, each expert's rows padded to a
          multiple of a block of `block` rows (at most T*k // block + min(E, T*k) blocks), and a
          `lax.fori_loop` over the blocks actually used: per block, the block's expert's weights
          sliced out (dynamic index) and two plain XLA dots [block, H] x [H, 2I], [block, I] x [I, H].
          Only the experts a step routes to are read, and FLOPs are the useful ones plus padding.
  dense   every expert on every token ([T, H] x [E, H, 2I]), then the routing-weighted sum over E
          (zero weight for unrouted experts): E / k x the useful FLOPs, every weight read once.
What the experts run on, on CPU: every dot above is an XLA:CPU dot that XLA compiles to a
YNNPACK GEMM (`__ynn_fusion` in the optimized HLO), on the host cores; the jax_engine/kernels CPU
matmul kernel is not used for experts. ragged_dot's HLO there is one dot of [T*k, E*H] x [E*H, 2I]
(the masked pairs against every expert's weights at once).

Measured (benchmarks/results/moe_dispatch.json, 2026-12-01, undisturbed; one layer of the
Qwen3-MoE-shaped benchmark model: H 1024, 64 experts, top-8, expert I 512, float32, routing
included; 2 AMD EPYC cores; ms per call, median of 3-5 alternating rounds):
    T                     1       16      128      512
    ragged            204.7    372.5   2326.7   5749.6
    sorted              4.5     24.6     68.0    151.0     (15-45x faster than ragged)
    dense              16.4     50.6    250.8    728.9
  sorted in a 3-layer lax.scan, ms per layer:
    layer's slice      73.2    136.1    172.7    225.0
    stacked + index     3.2     23.1     65.1    142.7
"sorted" wins at every T, so `choose_method` always picks it; "ragged" and "dense" stay selectable
(`method=`; ragged is a real grouped GEMM on TPU / GPU, not measured here: no accelerator).

Call it with the stacked [L, E, ...] expert weights and the layer index (`layer=`), not with the
layer's slice: a slice that a `lax.scan` over the layers hands to the layer body is copied whole
(every expert of the layer, 400 MB here) before the dispatch loop can read it, every step (the
"layer's slice" row: 23x slower at T = 1).

Parallelism. On a mesh with an `expert` axis (--ep) the experts' leading axis is sharded over it
(each device holds E / ep experts) and on the `model` axis (--tp) each expert's intermediate dim I
(jax_engine/checkpoint/layout.py). The FFN then runs under `shard_map`: every device routes the
(replicated) tokens itself, runs only the pairs routed to its own experts over its own slice of I,
and one psum over ('expert', 'model') combines the partial outputs (tokens and router stay
replicated; no all-to-all). The mesh is read from the weights' own sharding at trace time, so
the model code passes nothing. tests/engine/test_moe_parallel.py: EP 2, TP 2, EP 2 x TP 2 and
EP 4 give the logits of one device within 1e-4 and the same greedy tokens.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Act = Callable[[jax.Array], jax.Array]
METHODS = ("sorted", "ragged", "dense")
PARALLEL_AXES = ("expert", "model")


def route(h: jax.Array, router: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: (weights [T, k] in h's dtype, expert ids [T, k] int32)."""
    logits = jnp.dot(h, router.astype(h.dtype), preferred_element_type=jnp.float32).astype(h.dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_v, top_i = jax.lax.top_k(probs, top_k)                               # [T, k]
    if normalize:
        top_v = top_v / jnp.sum(top_v, axis=-1, keepdims=True)
    return top_v.astype(h.dtype), top_i.astype(jnp.int32)


def _local_pairs(top_i: jax.Array, e0, n_local: int) -> jax.Array:
    """Flat pair -> local expert id; pairs routed to other devices' experts get n_local (a sentinel
    group that sorts last and is never computed)."""
    e = top_i.reshape(-1) - e0
    return jnp.where((e >= 0) & (e < n_local), e, n_local)


def default_block(pairs: int, experts: int) -> int:
    """Rows per block of the sorted dispatch: 1 while there are no more pairs than experts (each
    block is then one pair: a gather-and-GEMV), else twice the mean rows per expert rounded up to
    a power of 2, at most 32 (the sweep of benchmarks/moe_dispatch.py: best 1, 4, 32, 32 at
    T = 1, 16, 128, 512 of the benchmark layer, with 16 and 32 within noise of each other)."""
    if pairs <= experts:
        return 1
    return min(32, 1 << (-(-2 * pairs // experts) - 1).bit_length())


Weight = Union[jax.Array, dict]     # an array, or weight-only int8 {"q", "s"}


def _q(w: Weight) -> jax.Array:
    return w["q"] if isinstance(w, dict) else w


def _layer(w: Weight, layer) -> Weight:
    """One layer of a stacked weight (layer None: `w` is one layer already)."""
    if layer is None:
        return w
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), w)


def _dense(w: Weight, dtype) -> jax.Array:
    """One layer's experts [E, K..., N...] in `dtype` (int8 scaled per expert and output channel)."""
    if not isinstance(w, dict):
        return w.astype(dtype)
    s = w["s"].reshape(w["s"].shape[:1] + (1,) + w["s"].shape[1:])            # [E, 1, N...]
    return (w["q"].astype(jnp.float32) * s).astype(dtype)


def experts_sorted(h: jax.Array, top_v: jax.Array, top_i: jax.Array, gate_up: jax.Array, down: jax.Array,
                   act: Act, e0=0, block: Optional[int] = None, layer=None) -> jax.Array:
    """Sort-by-expert dispatch in blocks of `block` rows; only the used blocks run (fori_loop).

    With `layer`, gate_up / down are the stacked [L, E, ...] weights and each block slices out
    just its expert of that layer: a per-layer slice handed in (a `lax.scan` over the layers)
    is copied whole before the loop can read it, every step (400 MB a layer for the benchmark
    model: 88 vs 4 ms a layer at T = 1)."""
    T, H = h.shape
    E, _, _, I = _q(gate_up).shape[-4:]
    k = top_i.shape[1]
    N = T * k
    B = block or default_block(N, E)
    e = _local_pairs(top_i, e0, E)                                           # [N] in 0..E
    order = jnp.argsort(e, stable=True)
    se = e[order]                                                            # sorted local expert ids
    sizes = jnp.bincount(e, length=E + 1)[:E].astype(jnp.int32)
    nblk = (sizes + B - 1) // B
    blk_end = jnp.cumsum(nblk)
    row_start = jnp.cumsum(sizes) - sizes                                    # first sorted pair of each expert
    se_c = jnp.minimum(se, E - 1)
    nb_max = N // B + min(E, N)                                              # blocks at most
    R = nb_max * B
    dest = jnp.where(se < E, (blk_end - nblk)[se_c] * B + jnp.arange(N) - row_start[se_c], R)   # padded row (R: none)
    x = jnp.zeros((R, H), h.dtype).at[dest].set(h[order // k], mode="drop")
    blk_expert = jnp.minimum(jnp.searchsorted(blk_end, jnp.arange(nb_max), side="right"), E - 1)
    lead = () if layer is None else (layer,)

    def expert(w: jax.Array, ex) -> jax.Array:          # one expert's matrix, sliced inside the loop
        start = lead + (ex,) + (0,) * (w.ndim - len(lead) - 1)
        return jax.lax.dynamic_slice(w, start, (1,) * (len(lead) + 1) + w.shape[len(lead) + 1:])

    def matmul(xb: jax.Array, w: Weight, ex, k_: int, n: int) -> jax.Array:
        """xb [B, k_] @ expert ex's [k_, n] matrix, float32 (int8: widened in the loop, the
        accumulator scaled per output channel)."""
        y = jnp.dot(xb, expert(_q(w), ex).reshape(k_, n).astype(h.dtype), preferred_element_type=jnp.float32)
        return y * expert(w["s"], ex).reshape(n) if isinstance(w, dict) else y

    def body(j, y):
        xb = jax.lax.dynamic_slice_in_dim(x, j * B, B)
        ex = blk_expert[j]
        g = matmul(xb, gate_up, ex, H, 2 * I).astype(h.dtype).reshape(B, 2, I)
        a = act(g[:, 0]) * g[:, 1]
        yb = matmul(a, down, ex, I, H).astype(h.dtype)
        return jax.lax.dynamic_update_slice_in_dim(y, yb, j * B, 0)

    y = jax.lax.fori_loop(0, blk_end[-1], body, jnp.zeros((R, H), h.dtype))
    w = jnp.where(se < E, top_v.reshape(-1)[order], 0).astype(h.dtype)
    yp = y.at[dest].get(mode="fill", fill_value=0) * w[:, None]
    return jnp.zeros((T, H), h.dtype).at[order // k].add(yp)


def experts_ragged(h: jax.Array, top_v: jax.Array, top_i: jax.Array, gate_up: jax.Array, down: jax.Array,
                   act: Act, e0=0, layer=None) -> jax.Array:
    """Pairs sorted by expert through two `jax.lax.ragged_dot` grouped GEMMs."""
    gate_up, down = _dense(_layer(gate_up, layer), h.dtype), _dense(_layer(down, layer), h.dtype)
    T, H = h.shape
    E, _, _, I = gate_up.shape
    k = top_i.shape[1]
    e = _local_pairs(top_i, e0, E)
    order = jnp.argsort(e, stable=True)
    token = order // k
    sizes = jnp.bincount(e, length=E + 1)[:E].astype(jnp.int32)             # other devices' pairs: no group
    gu = jax.lax.ragged_dot(h[token], gate_up.reshape(E, H, 2 * I).astype(h.dtype), sizes,
                            preferred_element_type=jnp.float32).reshape(-1, 2, I).astype(h.dtype)
    y = jax.lax.ragged_dot(act(gu[:, 0]) * gu[:, 1], down.astype(h.dtype), sizes, preferred_element_type=jnp.float32)
    w = jnp.where(e[order] < E, top_v.reshape(-1)[order], 0).astype(h.dtype)
    y = y.astype(h.dtype) * w[:, None]
    return jnp.zeros((T, H), h.dtype).at[token].add(y)


def experts_dense(h: jax.Array, top_v: jax.Array, top_i: jax.Array, gate_up: jax.Array, down: jax.Array,
                  act: Act, e0=0, layer=None) -> jax.Array:
    """Every (local) expert on every token, then the routing-weighted sum over the experts."""
    gate_up, down = _dense(_layer(gate_up, layer), h.dtype), _dense(_layer(down, layer), h.dtype)
    T, H = h.shape
    E = gate_up.shape[0]
    e = _local_pairs(top_i, e0, E).reshape(top_i.shape)                       # [T, k]
    comb = jnp.zeros((T, E + 1), h.dtype).at[jnp.arange(T)[:, None], e].add(top_v)[:, :E]   # [T, E]
    hb = jnp.broadcast_to(h, (E,) + h.shape)                                  # E as a batch dim: no weight copy
    g = jnp.einsum("eth,ehf->etf", hb, gate_up.reshape(E, H, -1).astype(h.dtype),
                   preferred_element_type=jnp.float32).astype(h.dtype).reshape(E, T, 2, -1)
    a = act(g[:, :, 0]) * g[:, :, 1]
    y = jnp.einsum("eti,eih->eth", a, down.astype(h.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("eth,te->th", y, comb.astype(jnp.float32)).astype(h.dtype)


_FFN = {"sorted": experts_sorted, "ragged": experts_ragged, "dense": experts_dense}


def choose_method(tokens: int, experts: int, top_k: int) -> str:
    """The measured winner on CPU at every T measured (benchmarks/results/moe_dispatch.json)."""
    return "sorted"


def expert_ffn(method: str, h, top_v, top_i, gate_up, down, act: Act, e0=0, layer=None) -> jax.Array:
    return _FFN[method](h, top_v, top_i, gate_up, down, act, e0=e0, layer=layer)


def _parallel_mesh(w: jax.Array):
    """The (abstract) mesh the expert weights are sharded on when it has an expert or model axis
    of size > 1, else None (one device)."""
    try:
        mesh = jax.typeof(w).sharding.mesh
    except AttributeError:
        return None
    shape = dict(getattr(mesh, "shape", {}) or {})
    return mesh if any(shape.get(a, 1) > 1 for a in PARALLEL_AXES) else None


def moe_mlp(h: jax.Array, router: jax.Array, gate_up: Weight, down: Weight, top_k: int, normalize: bool,
            act: Act, method: Optional[str] = None, layer=None) -> jax.Array:
    """h [T, H] -> [T, H] (method None: `choose_method` for this T). gate_up [E, H, 2, I] and
    down [E, I, H] of this layer, or with `layer` (an int32 scalar) the stacked [L, E, ...]
    weights of every layer (see `experts_sorted`: no per-layer copy), each an array or int8
    {"q", "s"}; router is this layer's."""
    T = h.shape[0]
    E = _q(gate_up).shape[-4]
    method = method or choose_method(T, E, top_k)
    mesh = _parallel_mesh(_q(gate_up))
    if mesh is None:
        top_v, top_i = route(h, router, top_k, normalize)
        return expert_ffn(method, h, top_v, top_i, gate_up, down, act, layer=layer)
    shape = dict(mesh.shape)
    ep = shape.get("expert", 1)
    axes = tuple(a for a in PARALLEL_AXES if shape.get(a, 1) > 1)
    e_ax = "expert" if "expert" in shape else None
    i_ax = "model" if "model" in shape else None
    stacked = layer is not None
    lead = (None,) if stacked else ()                                       # the stacked weights' layer axis

    def local(h, router, gate_up, down, li):
        top_v, top_i = route(h, router, top_k, normalize)                    # the same on every device
        e0 = jax.lax.axis_index("expert") * (E // ep) if ep > 1 else 0
        y = expert_ffn(method, h, top_v, top_i, gate_up, down, act, e0=e0, layer=li if stacked else None)
        return jax.lax.psum(y.astype(jnp.float32), axes).astype(h.dtype)

    gu_spec, dn_spec = P(*lead, e_ax, None, None, i_ax), P(*lead, e_ax, i_ax, None)
    if isinstance(gate_up, dict):                    # scales [(L,) E, 2, I] and [(L,) E, H]
        gu_spec = {"q": gu_spec, "s": P(*lead, e_ax, None, i_ax)}
        dn_spec = {"q": dn_spec, "s": P(*lead, e_ax, None)}
    specs = (P(), P(), gu_spec, dn_spec, P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(
        h, router, gate_up, down, jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32))
