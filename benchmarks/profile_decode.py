"""Where one decode step of the 'small' Llama goes (batch 1 by default), through the engine and below it.

A decode step is the engine's one ragged step program (runner.step) over B rows of one token
each (StepRow(tokens=[last], start=position, ...) with one SampleRow), as the scheduler builds it
when no prompt is being prefilled.

Layers timed (each the median and minimum of many calls, context ~ prompt + new/2 = 192):
  engine_token_interval   a real streamed request: gap between tokens at the asyncio consumer
  runner_decode           ModelRunner.step() over the B decode rows: host arrays -> device_put ->
                          program -> fetch
  runner_host_args        ModelRunner._step_args() alone (numpy rows, sampling arrays, device_put)
  decode_program          the compiled step program alone (args prebuilt, state donated)
  bare_forward            jit(decoder module + logits + argmax) with the same StepInputs (no sampling)
  weights_gemv_chain      only the layer matmuls + lm_head on one token (reads every weight once),
                          each matrix on the path (CPU kernel or XLA) the decoder routes it to
  kv_gather               only the per-layer gather of K and V through the page table (the
                          reference attention does it; the CPU decode kernel reads pages in place)
  sampling_tail           penalties + argmax + log-softmax/top-k + count update over the vocab
plus the compiled step program's own cost analysis (flops, bytes accessed), and the step
program at the smaller page bucket to show what the attention's page bucket costs.

Run:  python -m benchmarks.profile_decode [--quick] [--iters N]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C
from benchmarks import generate_vs_hf as G
from benchmarks.peer_worker import probe_limits
from jax_engine.decode.rows import SampleRow, SamplingRow, StepRow

NAME = "profile_decode"


def bench(fn: Callable[[], Any], iters: int) -> dict:
    fn()
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"ms_p50": C.rnd(C.percentile(ts, 50) * 1e3, 3), "ms_min": C.rnd(min(ts) * 1e3, 3),
            "ms_p90": C.rnd(C.percentile(ts, 90) * 1e3, 3)}


def greedy_row() -> SamplingRow:
    return SamplingRow(temperature=0.0)


def weights_chain(graphdef, params, x):
    """Only the layer matmuls and the LM head on x [B, 1, H] (reads every weight once), each
    matrix on the path the decoder module routes it to (CPU kernel on packed panels, or XLA)."""
    import jax.numpy as jnp

    from jax_engine.models import decoder

    m = decoder.merge(graphdef, params)
    cfg = m.cfg
    kvh = cfg.num_kv_heads * cfg.kv_repeat
    G, D, rows = cfg.num_heads // kvh, cfg.head_dim, x.shape[0] * x.shape[1]

    def layer(carry, ly, _):
        x, li = carry
        mm = lambda lin, v, tail: decoder.matmul(cfg, lin, li, v, tail, rows)  # noqa: E731
        qkv = mm(ly.self_attn.qkv_proj, x, (kvh, G + 2, D))
        x = x + mm(ly.self_attn.o_proj, qkv[..., :G, :], (cfg.hidden_size,))
        gu = mm(ly.mlp.gate_up_proj, x, (2, cfg.intermediate_size))
        return x + mm(ly.mlp.down_proj, gu[..., 0, :] * gu[..., 1, :], (cfg.hidden_size,)), li + 1

    x, _ = decoder.scan_layers(m.model.layers, cfg, rows, layer, (x, jnp.int32(0)))
    return m.logits(x[:, 0])


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few iterations")
    ap.add_argument("--iters", type=int, default=None, help="calls per measurement (default 50; quick 10)")
    ap.add_argument("--context", type=int, default=None, help="tokens in the KV cache (default 192; quick 80)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | int8 (float32 + int8 weights)")
    ap.add_argument("--batch", type=int, default=1, help="decode rows (default 1; quick at most 4)")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    C.engine_process()
    quick = a.quick
    iters = a.iters or (10 if quick else 50)
    model = "tiny" if quick else "small"
    ctx = a.context or (80 if quick else 192)
    max_running, max_model_len = (4, 128) if quick else (max(16, a.batch), 512)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_engine.decode import sampling
    from jax_engine.models import decoder

    doc = C.header(NAME, quick, sys.argv[1:] if argv is None else argv)
    doc["quiet_wait"] = C.wait_for_quiet(0 if quick else 60)
    total = C.CpuWindow().start()
    path = G.ensure_model(model)
    eng = G.EngineSide(path, "float32" if a.dtype == "int8" else a.dtype, "int8" if a.dtype == "int8" else "none",
                       max_running, max_model_len)
    runner = eng.runner()
    cfg, ps = runner.cfg, runner.rc.page_size
    B = a.batch
    wb_all = eng.weight_bytes([B])
    wb = {**wb_all, "per_decode_step": wb_all["per_decode_step"][str(B)]}    # the bytes of this batch's step
    res: dict[str, Any] = {}

    # 1. a real request through the engine (asyncio consumer side)
    vocab = cfg.vocab_size
    new = 32 if quick else 128
    prompt = G.make_prompts(B, ctx - new // 2, vocab, 77)
    r = eng.generate(prompt, new)
    res["engine_token_interval"] = {"ms_p50": C.rnd(r["ms_per_step_p50"], 3), "decode_tok_s": C.rnd(r["decode_tok_s"], 1)}

    # B decode rows at context `ctx` (one token each, at position ctx - 1), row i on its own pages
    # and penalty slot i (the scheduler is idle: the runner is ours)
    npg = (ctx + ps - 1) // ps

    def make_row(i: int, length: int) -> StepRow:
        pg = list(range(1 + i * npg, 1 + i * npg + (length + ps - 1) // ps))
        return StepRow(tokens=[5], start=length - 1, pages=pg, samples=[SampleRow(i, greedy_row())])

    rows = [make_row(i, ctx) for i in range(B)]
    res["runner_decode"] = bench(lambda: runner.step(rows, True), iters)
    res["runner_host_args"] = bench(lambda: runner._step_args(rows), iters)

    # a decode step is one program, step (args: params, state, StepInputs, sample_idx,
    # slot ids, sampling; key: token bucket, page bucket)
    prog = "step"
    key, args = runner._step_args(rows)
    exe = runner.programs.get(prog, key, args)
    R = runner.rows_for(key[0])         # the program's rows (B real, the rest padding)

    def run_program() -> None:
        out, runner.state = exe(args[0], runner.state, *args[2:])
        jax.block_until_ready(out)

    res["decode_program"] = bench(run_program, iters)
    res["decode_program"]["key"] = {"program": prog, "token_bucket": key[0], "rows": R, "page_bucket": key[1],
                                    "kv_tokens_gathered": key[1] * ps}
    try:
        ca = exe.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        res["decode_program"]["cost_analysis"] = {k: float(v) for k, v in (ca or {}).items()
                                                  if k in ("flops", "bytes accessed", "transcendentals")}
    except Exception as e:  # noqa: BLE001 -- cost analysis is best-effort on CPU
        res["decode_program"]["cost_analysis"] = f"unavailable: {e!r}"

    # the same program at the smallest page bucket that still holds a short context
    small_pb = runner.page_buckets[0] if len(runner.page_buckets) == 1 else runner.page_buckets[-2]
    short = min(ctx, small_pb * ps)
    key_s, args_s = runner._step_args([make_row(i, short) for i in range(B)])
    exe_s = runner.programs.get(prog, key_s, args_s)

    def run_small() -> None:
        out, runner.state = exe_s(*(args_s[0], runner.state, *args_s[2:]))
        jax.block_until_ready(out)

    res["decode_program_small_page_bucket"] = bench(run_small, iters)
    res["decode_program_small_page_bucket"]["key"] = {"page_bucket": key_s[1], "context": short}

    # 2. below the runner: hand-built programs on the same params / cache, with the step's own inputs
    params = runner.params
    inp, sample_idx = args[2], args[3]          # the StepInputs and each row's last-token index
    table = inp.page_table[:B]                  # the B live rows' [B, page bucket] tables

    def fwd(params, k, v, inp, sample_idx):
        model = decoder.merge(runner.graphdef, params)
        h, k, v = model(k, v, inp, ps)
        return jnp.argmax(model.logits(h[sample_idx]), -1), k, v

    fwd_j = jax.jit(fwd, donate_argnums=(1, 2))

    def run_fwd() -> None:
        st = runner.state
        tok, k, v = fwd_j(params, st["k"], st["v"], inp, sample_idx)
        runner.state = {**st, "k": k, "v": v}
        tok.block_until_ready()

    res["bare_forward"] = bench(run_fwd, iters)

    def gemv_chain(params, x):
        return weights_chain(runner.graphdef, params, x)

    x0 = jnp.ones((B, 1, cfg.hidden_size), runner.dtype) * 0.01
    gemv_j = jax.jit(gemv_chain)
    res["weights_gemv_chain"] = bench(lambda: gemv_j(params, x0).block_until_ready(), iters)
    t = res["weights_gemv_chain"]["ms_min"] / 1e3
    res["weights_gemv_chain"]["weight_gbps_at_min"] = C.rnd(wb["per_decode_step"] / t / 1e9, 2)

    def kv_gather(k, v, table):
        B, P = table.shape
        idx = (table[:, :, None] * ps + jnp.arange(ps)[None, None]).reshape(B, P * ps)

        def layer(acc, li):
            return acc + k[li, idx].sum() + v[li, idx].sum(), None
        acc, _ = jax.lax.scan(layer, jnp.float32(0), jnp.arange(cfg.num_layers))
        return acc

    kv_j = jax.jit(kv_gather)
    res["kv_gather"] = bench(lambda: kv_j(runner.state["k"], runner.state["v"], table).block_until_ready(), iters)

    sa = runner._sa([greedy_row()] * B, R)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((R, vocab)).astype(np.float32))
    slot_ids = jnp.asarray(np.arange(R, dtype=np.int32))

    def tail(logits, counts, pm, slot_ids, sa):
        lg = sampling.process_logits(logits, sa, counts[slot_ids], pm[slot_ids])
        tok = sampling.greedy(lg)
        out = sampling.logprobs_of(logits, tok, runner.rc.top_n)
        return tok, out, counts.at[slot_ids, tok].add(1)

    tail_j = jax.jit(tail, donate_argnums=(1,))

    def run_tail() -> None:
        st = runner.state
        tok, _, counts = tail_j(logits, st["counts"], st["pm"], slot_ids, sa)
        runner.state = {**st, "counts": counts}
        tok.block_until_ready()

    res["sampling_tail"] = bench(run_tail, iters)

    # one bandwidth probe, in a short-lived peer process (torch never loads in this one)
    # the CPU window closes before the probe: its peer process would count as "others" and mark
    # every run disturbed (the probe is ours, and the timings above are already taken)
    cpu = total.stop()
    limits = C.combine_limits([probe_limits(0.5 if quick else 2.0, 3 if quick else 5, matmul=False)])
    bw = limits["torch_sum_gbps"]
    kv_itemsize = int(runner.kv_dtype.itemsize)      # the engine's real KV dtype (float32 on CPU)
    kv_bytes = B * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_itemsize
    floor_ms = (wb["per_decode_step"] + kv_bytes) / (bw * 1e9) * 1e3

    def p(k: str) -> float:
        return res[k]["ms_p50"]
    doc["setup"] = {"model": model, "dtype": a.dtype, "batch": B, "context": ctx, "iters": iters, "weight_bytes": wb,
                    "matmul": cfg.matmul, "attention_backend": cfg.attention_backend, "kv_itemsize": kv_itemsize,
                    "bandwidth_probe": (f"one probe: torch sum over {limits['buffer_gib']} GiB, all cores, best of "
                                        f"{limits['probe_runs'][0]['repeats']} repeats, in a peer process: {bw} GB/s"),
                    "engine_args": {"max_running_requests": max_running, "max_model_len": max_model_len,
                                    "page_size": ps}}
    doc["limits"] = limits
    doc["timings"] = res
    doc["breakdown_ms_p50"] = {
        "bandwidth_floor ((weights + live KV) / torch read rate)": C.rnd(floor_ms, 3),
        "weights_gemv_chain": p("weights_gemv_chain"),
        "kv_gather": p("kv_gather"),
        "sampling_tail": p("sampling_tail"),
        "bare_forward": p("bare_forward"),
        "decode_program": p("decode_program"),
        "decode_program - bare_forward (sampling, logprobs, state)": C.rnd(p("decode_program") - p("bare_forward"), 3),
        "runner_decode - decode_program (host args, device_put, fetch)": C.rnd(p("runner_decode") - p("decode_program"), 3),
        "engine_token_interval - runner_decode (scheduler, events, asyncio)": C.rnd(
            (res["engine_token_interval"]["ms_p50"] or 0) - p("runner_decode"), 3),
        "engine_token_interval": res["engine_token_interval"]["ms_p50"],
    }
    doc["compilations_after_warmup"] = eng.engine.compilations_after_warmup()
    doc["process_isolation"] = {"engine": C.isolation_report(C.ENGINE_BLOCKED)}
    doc["cpu"] = cpu
    eng.close()
    name = NAME + ("" if a.dtype == "float32" else f"_{a.dtype}") + ("" if B == 1 else f"_b{B}")
    return C.finish(doc, name, quick)


if __name__ == "__main__":
    main()
