"""Which adapter holds which slot, and who is using it (host side, thread-safe).

Slot ids are 1-based (0 = the base model; bank index = slot - 1). Each load gets a fresh
prefix-cache root, so KV pages computed under an adapter are never matched by the base model, by
another adapter, or by a later adapter loaded into the same slot. Unloading an adapter that
requests still use only stops new requests; its slot is freed when the last one finishes.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, replace

from jax_engine.errors import AlreadyExists, NotFound, Overloaded
from jax_engine.types import AdapterInfo


@dataclass
class _Entry:
    info: AdapterInfo
    slot: int
    root: bytes
    in_flight: int = 0
    unloading: bool = False


class AdapterTable:
    def __init__(self, slots: int):
        self.slots = slots
        self._free = list(range(slots, 0, -1))
        self._entries: dict[str, _Entry] = {}
        self._reserved: set[str] = set()
        self._lock = threading.Lock()
        self._loads = itertools.count(1)

    def reserve(self, name: str) -> int:
        """A free slot for adapter `name` (then `commit` or `cancel`)."""
        with self._lock:
            if name in self._entries or name in self._reserved:
                raise AlreadyExists(f"LoRA adapter {name!r} is already loaded")
            if not self._free:
                raise Overloaded(f"all {self.slots} LoRA slots are in use (--max-loras); unload an adapter first")
            self._reserved.add(name)
            return self._free.pop()

    def cancel(self, name: str, slot: int) -> None:
        with self._lock:
            self._reserved.discard(name)
            self._free.append(slot)

    def commit(self, info: AdapterInfo, slot: int) -> None:
        with self._lock:
            self._reserved.discard(info.name)
            self._entries[info.name] = _Entry(info, slot, b"lora:%d|" % next(self._loads))

    def acquire(self, name: str) -> tuple[int, bytes]:
        """(slot, prefix-cache root) for a new request using `name`; NotFound if it is not loaded."""
        with self._lock:
            e = self._entries.get(name)
            if e is None or e.unloading:
                state = "is being unloaded" if e is not None else "is not loaded"
                raise NotFound(f"LoRA adapter {name!r} {state} (loaded: {sorted(self.names())})")
            e.in_flight += 1
            return e.slot, e.root

    def release(self, name: str) -> None:
        """A request using `name` finished."""
        with self._lock:
            e = self._entries[name]
            e.in_flight -= 1
            if e.unloading and e.in_flight == 0:
                self._drop(name)

    def unload(self, name: str) -> None:
        with self._lock:
            e = self._entries.get(name)
            if e is None or e.unloading:
                raise NotFound(f"LoRA adapter {name!r} is not loaded")
            e.unloading = True
            if e.in_flight == 0:
                self._drop(name)

    def _drop(self, name: str) -> None:
        self._free.append(self._entries.pop(name).slot)

    def names(self) -> list[str]:
        return [n for n, e in self._entries.items() if not e.unloading]

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries or name in self._reserved

    def used(self) -> int:
        with self._lock:
            return self.slots - len(self._free)

    def infos(self) -> list[AdapterInfo]:
        with self._lock:
            return [replace(e.info, state="unloading" if e.unloading else "loaded", in_flight=e.in_flight)
                    for e in self._entries.values()]
