"""jax_engine/heap.py: a frozen heap keeps full collections off what start-up built, and
loading or releasing a model re-freezes so that a released model's objects can still go."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest

from jax_engine import heap


class _Node:
    def __init__(self) -> None:
        self.me = self          # a cycle: only the cyclic collector frees it


@pytest.fixture(autouse=True)
def _thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_frozen_objects_are_skipped_until_refrozen():
    node = _Node()
    alive = weakref.ref(node)
    heap.freeze()
    assert gc.get_freeze_count() > 0
    del node
    gc.collect()
    assert alive() is not None              # frozen: the collection did not look at it
    heap.refreeze()                         # e.g. after a model was released
    assert alive() is None and gc.get_freeze_count() > 0


def test_refreeze_does_nothing_in_a_process_that_never_froze():
    node = _Node()
    alive = weakref.ref(node)
    del node
    heap.refreeze()
    assert gc.get_freeze_count() == 0 and alive() is not None
    gc.collect()
    assert alive() is None


def test_the_engine_refreezes_after_loading_and_releasing_a_model(monkeypatch):
    from jax_engine import engine as engine_mod
    from jax_engine.config import EngineArgs, ModelSpec

    calls = []
    monkeypatch.setattr(engine_mod.heap, "refreeze", lambda: calls.append("refreeze"))
    worker = SimpleNamespace(info=SimpleNamespace(state="loaded"), warmup=lambda progress: None)
    monkeypatch.setattr(engine_mod, "resolve", lambda spec, args: spec)
    monkeypatch.setattr(engine_mod, "_make_worker", lambda spec, args, channel: worker)
    eng = engine_mod.Engine(EngineArgs(models=[]))
    eng.load_model_sync(ModelSpec(name="m", path="/nowhere"), progress=False, warmup=False)
    assert calls == ["refreeze"]
    eng.release_model_sync("m")
    assert calls == ["refreeze", "refreeze"]
