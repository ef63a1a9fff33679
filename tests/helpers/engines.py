"""Engine-side helpers shared by test files and benchmarks/parity_report.py: the decoder parity
prompts and engine arguments, prompt logits through the paged cache, greedy decoding through
`Engine.generate`, and a small loaded engine for tests of what flags resolve to."""
from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from jax_engine.config import EngineArgs, ModelSpec
from jax_engine.decode.parity import prompt_logits
from jax_engine.engine import Engine
from jax_engine.types import GenerateRequest, SamplingParams

PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(100, 130)), [11] * 5 + list(range(200, 251))]


def small_args(**kw) -> EngineArgs:
    base = dict(max_running_requests=4, max_num_batched_tokens=64, max_model_len=128, page_size=8)
    base.update(kw)
    return EngineArgs(**base)


def engine_logits(worker, prompt: list[int]) -> np.ndarray:
    """Logits of every prompt position through the paged-cache forward (fresh pages 1..P)."""
    return prompt_logits(worker.replicas[0].runner, prompt)


async def greedy_all(engine: Engine, prompts: list[list[int]], n: int, model: str = None) -> list[list[int]]:
    async def one(p):
        toks = []
        req = GenerateRequest(request_id="", prompt_ids=p, model=model,
                              params=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
        async for o in engine.generate(req):
            toks += o.new_token_ids
        return toks

    return await asyncio.gather(*[one(p) for p in prompts])


def engine_greedy(server_loop, engine, prompt, n) -> list[int]:
    async def run():
        toks = []
        req = GenerateRequest(request_id="", prompt_ids=list(prompt),
                              params=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
        async for out in engine.generate(req):
            toks += out.new_token_ids
        return toks

    return server_loop.run(run())


@contextlib.contextmanager
def small_engine(path: str, **engine_kw):
    """A loaded (not warmed) engine serving `path` as model "m" with a small cache, shut down on
    exit: for tests that check what flags resolve to, not for serving."""
    kw = dict(max_running_requests=2, max_num_batched_tokens=32, max_model_len=64, page_size=16, num_pages=8)
    engine = Engine(EngineArgs(models=[ModelSpec(name="m", path=path)], **{**kw, **engine_kw}))
    try:
        engine.load_all(progress=False, warmup=False)
        yield engine
    finally:
        engine.shutdown(timeout=2.0)
