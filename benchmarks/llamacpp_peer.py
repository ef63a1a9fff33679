"""The llama.cpp peer (llama-cpp-python) for the generation benchmark, in its own process.

The GGUF files come from the benchmark's own HF folder through llama.cpp's convert_hf_to_gguf.py
(benchmarks/gguf.py: F32, F16 or BF16, Q8_0). This process has neither jax nor torch.

How it runs, and why this way: llama-cpp-python's high-level `Llama` generates one sequence at a
time (`Llama.generate` feeds tokens through `eval` and samples in Python); it has no batched
generate. So every batch size uses the low-level `llama_cpp` API the way llama.cpp's own
`llama-batched-bench` does:
  * one model (`llama_model_load_from_file`, mmap, CPU only) and, per batch size B, one context
    (`llama_init_from_model`) with n_seq_max = B, n_ctx = B x (prompt + new tokens, rounded up
    to 256) (llama.cpp's default per-sequence KV streams, not unified), n_batch = n_ubatch =
    max(512, B x prompt) so a whole prefill is one ubatch, n_threads = n_threads_batch = the
    usable cores, everything else llama.cpp's default (flash attention 'auto', which enables it
    on CPU; KV cache F16);
  * prefill: one `llama_batch` of B x T tokens, sequence s at positions 0..T-1 with seq_id s,
    logits requested only at each sequence's last token; one `llama_decode`;
  * decode: per step one `llama_batch` of B tokens, one per seq_id, all at the same position;
    one `llama_decode`; greedy = argmax over each returned row of logits (numpy; what
    llama.cpp's greedy sampler does), every step's next token fed back; EOS is not checked
    (exactly `new_tokens` per sequence, as on the other sides);
  * the KV cache is cleared (`llama_memory_clear`) before every call.
Token ids go in directly (the benchmark model's tokenizer is a padded toy; no text is involved).

Timing, on this process's clock, with the same definitions as the transformers peer:
  prefill_s     call start -> the first tokens chosen (the prompt's llama_decode + argmax)
  decode_tok_s  B x (new - 1) / (last step's tokens chosen - first tokens chosen)
  e2e_s         the whole call
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

BLOCKED = C.PEER_BLOCKED + ("torch",)


def context_shape(batch: int, prompt_len: int, new_tokens: int) -> dict:
    """The context parameters used for batch size `batch` (see the module docstring)."""
    per_seq = -(-(prompt_len + new_tokens) // 256) * 256
    n_batch = max(512, batch * prompt_len)
    return {"n_seq_max": batch, "n_ctx": batch * per_seq, "n_batch": n_batch, "n_ubatch": n_batch}


class LlamaCppWorker:
    def __init__(self) -> None:
        self.model = None
        self.ctxs: dict[int, Any] = {}
        self.batches: dict[int, Any] = {}
        self.path: str | None = None
        self.vocab = 0

    # ---------------------------------------------------------------- general
    def cmd_hello(self) -> dict:
        import llama_cpp
        from llama_cpp import _logger

        _logger.set_verbose(False)
        llama_cpp.llama_backend_init()
        return {"threads": C.usable_cores(), "llama_cpp_python": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                **C.isolation_report(BLOCKED)}

    def cmd_isolation(self) -> dict:
        return C.isolation_report(BLOCKED)

    # ---------------------------------------------------------------- model
    def cmd_load(self, path: str, batches: list[int], prompt_len: int, new_tokens: int,
                 extra_bufts: bool = True) -> dict:
        """Load a GGUF file and make one context per batch size (the previous model is freed).
        extra_bufts=False turns off llama.cpp's extra CPU buffer types (the repacked and AMX weight
        layouts), as `--no-extra-bufts` / `--no-repack` users do where that path fails."""
        import llama_cpp as L

        self.cmd_unload()
        t0 = time.perf_counter()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        if not extra_bufts:
            mp.use_extra_bufts = False
        model = L.llama_model_load_from_file(path.encode(), mp)
        if not model:
            raise RuntimeError(f"llama_model_load_from_file failed for {path}")
        self.model, self.path = model, path
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        threads = C.usable_cores()
        shapes = {}
        for B in sorted(set(batches)):
            shape = context_shape(B, prompt_len, new_tokens)
            cp = L.llama_context_default_params()
            for k, v in shape.items():
                setattr(cp, k, v)
            cp.n_threads = cp.n_threads_batch = threads
            ctx = L.llama_init_from_model(model, cp)
            if not ctx:
                raise RuntimeError(f"llama_init_from_model failed for batch {B}: {shape}")
            self.ctxs[B] = ctx
            self.batches[B] = L.llama_batch_init(shape["n_batch"], 0, 1)
            shapes[B] = {**shape, "n_ctx_actual": L.llama_n_ctx(ctx), "n_threads": threads,
                         "flash_attn_type": "auto (llama.cpp default)", "type_k": int(cp.type_k),
                         "type_v": int(cp.type_v), "kv_unified": bool(cp.kv_unified)}
        buf = (L.ctypes.c_char * 256)()
        L.llama_model_desc(model, buf, 256)
        return {"load_s": time.perf_counter() - t0, "path": path, "desc": buf.value.decode(errors="replace"),
                "params": int(L.llama_model_n_params(model)), "file_bytes": os.path.getsize(path),
                "model_bytes": int(L.llama_model_size(model)), "vocab": self.vocab, "contexts": shapes}

    def cmd_unload(self) -> dict:
        import llama_cpp as L

        for b in self.batches.values():
            L.llama_batch_free(b)
        for ctx in self.ctxs.values():
            L.llama_free(ctx)
        if self.model:
            L.llama_model_free(self.model)
        self.model, self.ctxs, self.batches, self.path = None, {}, {}, None
        return {}

    # ---------------------------------------------------------------- generate
    def cmd_generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """Greedy generation of exactly `new_tokens` for every prompt, all in one batch."""
        import llama_cpp as L
        import numpy as np

        B, T = len(prompts), len(prompts[0])
        ctx, batch = self.ctxs[B], self.batches[B]
        V = self.vocab
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        # views on the batch's arrays; the prefill batch is filled before the clock starts
        n_max = B * T
        tok = np.ctypeslib.as_array(batch.token, shape=(max(n_max, B),))
        pos = np.ctypeslib.as_array(batch.pos, shape=(max(n_max, B),))
        nseq = np.ctypeslib.as_array(batch.n_seq_id, shape=(max(n_max, B),))
        want = np.ctypeslib.as_array(batch.logits, shape=(max(n_max, B),))
        tok[:n_max] = np.asarray(prompts, dtype=np.int32).reshape(-1)
        pos[:n_max] = np.tile(np.arange(T, dtype=np.int32), B)
        nseq[:n_max] = 1
        want[:n_max] = 0
        want[T - 1:n_max:T] = 1
        for i in range(n_max):
            batch.seq_id[i][0] = i // T
        batch.n_tokens = n_max
        out = np.empty((B, new_tokens), dtype=np.int64)
        stamps: list[float] = []

        def step() -> None:
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(B, V))
            out[:, len(stamps)] = logits.argmax(axis=1)
            stamps.append(time.perf_counter())

        t0 = time.perf_counter()
        step()                                   # prefill: B x T tokens, B rows of logits
        for i in range(B):                       # from here on, token i belongs to sequence i
            batch.seq_id[i][0] = i
        nseq[:B] = 1
        want[:B] = 1
        batch.n_tokens = B
        for k in range(1, new_tokens):
            tok[:B] = out[:, k - 1]
            pos[:B] = T + k - 1
            step()
        t1 = time.perf_counter()
        steps = max(1, len(stamps) - 1)
        dec = stamps[-1] - stamps[0]
        return {"prefill_s": stamps[0] - t0, "decode_tok_s": B * (len(stamps) - 1) / dec if dec > 0 else float("nan"),
                "e2e_s": t1 - t0, "steps": len(stamps), "ms_per_step": dec / steps * 1e3,
                "output_ids": out.tolist()}


def main() -> None:
    from benchmarks.peer_worker import run_worker

    run_worker(LlamaCppWorker, BLOCKED)


if __name__ == "__main__":
    main()
