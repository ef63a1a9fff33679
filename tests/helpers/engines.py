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


async def greedy_all(engine: Engine, prompts: list[list[int]], n: int, model: str = None,
                     adapter: str = None) -> list[list[int]]:
    """n greedy tokens per prompt with EOS banned throughout, as hf_models.hf_greedy's min_new_tokens
    does (ignore_eos alone would still let EOS be drawn where transformers draws the runner-up)."""
    async def one(p):
        toks = []
        req = GenerateRequest(request_id="", prompt_ids=p, model=model, adapter=adapter,
                              params=SamplingParams(temperature=0.0, max_new_tokens=n, min_new_tokens=n))
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


# the tiny decoder of the scheduler and constraint tests, and an engine over it
PS = 8
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def make_engine(path: str, warmup: bool = True, **kw) -> Engine:
    # burst steps off unless a test asks (their extra buckets would compile in every engine here)
    args = dict(max_running_requests=8, max_num_batched_tokens=64, max_model_len=128, page_size=PS,
                max_waiting_requests=256, burst_batched_tokens=0)
    args.update(kw)
    eng = Engine(EngineArgs(models=[ModelSpec(name="gen", path=path)], **args))
    eng.load_all(progress=False, warmup=warmup)
    return eng


async def run(engine: Engine, prompt, **params) -> dict:
    """Collect one request's events into tokens / text / final info per index."""
    req = GenerateRequest(request_id=params.pop("request_id", ""), prompt_ids=prompt if isinstance(prompt, list) else None,
                          prompt=prompt if isinstance(prompt, str) else None, params=SamplingParams(**params))
    res: dict = {}
    async for o in engine.generate(req):
        r = res.setdefault(o.index, {"tokens": [], "text": "", "logprobs": [], "final": None})
        r["tokens"] += o.new_token_ids
        r["text"] += o.new_text
        r["logprobs"] += o.logprobs or []
        if o.prompt_logprobs is not None:
            r["prompt_logprobs"] = o.prompt_logprobs
        if o.finished:
            r["final"] = o
    return res


def build_tiny_decoder(path: str) -> str:
    """The TINY demo-architecture decoder (random weights, the demo tokenizer) at `path`."""
    from jax_engine.models.demo import build_demo_generator, llama_config

    build_demo_generator(path, config=llama_config(**TINY, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    return path
