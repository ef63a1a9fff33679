"""Keeping Python's cyclic garbage collector off the serving path.

A warmed-up engine holds ~540,000 objects the collector tracks (most of them JAX's traced
programs and caches: jaxpr variables and equations, source infos, functions), and every full
(generation 2) collection walks all of them with the GIL held: 262 ms on a 2-vCPU Xeon with the
trained benchmark model loaded, during which no step runs and no token is sent. Python runs one
whenever objects that survived the younger generations reach a quarter of that population, so a
busy server hit it every few thousand requests (8 sampled streams of the trained model with
suffix speculation, whose indexes keep objects alive: a 266 ms and a 105 ms pause within 10
passes of 3,072 tokens, one pass at 2,637 against ~3,400 tok/s).

`freeze` moves everything alive after start-up into the permanent generation, which collections
skip; objects made while serving are still collected as before. The process owner calls it (the
server once its models are warm, a benchmark the same way); a library user who never freezes
keeps Python's default behaviour. Loading or unloading a model later calls `refreeze`, which does
nothing in a process that never froze.
"""
from __future__ import annotations

import gc


def freeze() -> None:
    """Collect what is garbage now, then exempt every object still alive from collections. Objects
    an earlier call froze are collected first if they became garbage since (a released model, an
    engine a benchmark dropped)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def refreeze() -> None:
    """freeze() again after a model was loaded or released, in a process that froze its heap."""
    if gc.get_freeze_count():
        freeze()
