"""Engine._submit: small requests are validated and tokenized on the event loop, large ones on an
executor thread (abortable if the consumer leaves meanwhile); _embed_chars sizes embed requests."""
from __future__ import annotations

import asyncio
import threading

import pytest

from jax_engine.engine import TOKENIZE_INLINE_CHARS, _embed_chars, _submit
from jax_engine.types import EmbedRequest


def test_inline_runs_on_the_loop_thread_and_large_on_another():
    async def main():
        here = threading.get_ident()
        inline = await _submit(True, threading.get_ident, lambda _: None)
        off = await _submit(False, threading.get_ident, lambda _: None)
        return here, inline, off

    here, inline, off = asyncio.run(main())
    assert inline == here and off != here


def test_submit_errors_propagate_on_both_paths():
    def bad():
        raise ValueError("refused")

    for inline in (True, False):
        with pytest.raises(ValueError, match="refused"):
            asyncio.run(_submit(inline, bad, lambda _: None))


def test_a_consumer_leaving_during_an_executor_submit_aborts_its_result():
    aborted: list[str] = []
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(5)
        return "handle-1"

    async def main():
        task = asyncio.create_task(_submit(False, slow, aborted.append))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(100):
            if aborted:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert aborted == ["handle-1"]


def test_embed_chars_counts_characters_ids_and_pairs():
    assert _embed_chars(EmbedRequest("a", texts=["abc", "de"])) == 5
    assert _embed_chars(EmbedRequest("b", token_ids=[[1, 2, 3], [4]])) == 4
    assert _embed_chars(EmbedRequest("c", pairs=[("q", "doc")])) == 4
    assert _embed_chars(EmbedRequest("d", texts=[7, None])) == 2        # malformed items count one
    assert _embed_chars(EmbedRequest("e", texts=["x" * (TOKENIZE_INLINE_CHARS + 1)])) > TOKENIZE_INLINE_CHARS


@pytest.mark.parametrize("matmul, models, started", [("auto", 1, True), ("xla", 1, False), ("auto", 0, False)])
def test_engine_starts_the_kernel_build_on_cpu_unless_xla_is_forced(monkeypatch, tmp_path, matmul, models, started):
    """Creating an engine on CPU starts the kernel build at once (so it overlaps model loading),
    not with --cpu-matmul xla and not for an engine with no model."""
    from jax_engine import engine as E
    from jax_engine.config import EngineArgs, ModelSpec
    from jax_engine.kernels import cpu as cpu_kernels

    calls = []
    monkeypatch.setattr(cpu_kernels, "build_in_background", lambda: calls.append(1))
    specs = [ModelSpec(name="m", path=str(tmp_path))] * models
    E.Engine(EngineArgs(models=specs, cpu_matmul=matmul, compile_cache_dir=str(tmp_path / "jc")))
    assert bool(calls) is started
