"""More than one host: one TP mesh over every process's devices, driven by process 0.

JAX is multi-controller: every process must launch the same programs, in the same order, with
the same host inputs. So process 0 runs the fronts and the schedulers as usual, and each of its
model runners publishes every device-touching call (the ragged step, prompt logprobs, ...; the
methods runner.py marks `@mirrored`) before making it. The other processes build the same decoder
runners (same flags, same checkpoint), compile the same buckets, and `follow` the published
calls one by one. The calls travel through the key-value store of JAX's own coordination
service (`jax.distributed`), not through a channel of ours.

A step's outputs are replicated over the mesh (runner.py constrains them), so process 0 reads
them from its own devices; followers never fetch anything.

The channel is made once, by `initialize`, in the process's entry point (frontends/cli.py),
and handed down: process 0's Engine gives it to each decoder worker, which sets it as its
runners' `mirror`;
a follower passes it to `follow`. There is no module-level state here.

Failure model: the processes are one job. If any process dies, the collectives of the others
cannot complete; JAX's coordination service notices the missing heartbeats and ends the job.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Optional

import numpy as np

from jax_engine.decode.rows import ROW_TYPES
from jax_engine.decode.runner import MIRRORED

log = logging.getLogger("xlaserve.multihost")

# Runner methods that launch device programs; everything else is host-side and stays local.
_PREFIX = "xlaserve/step/"
_KEEP = 256          # published calls kept in the store (followers lag a step at most: collectives)
_STOP = "__stop__"


@dataclass
class DistributedArgs:
    coordinator_address: Optional[str] = None
    num_processes: int = 1
    process_id: int = 0

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1


def initialize(dist: DistributedArgs) -> Optional["StepChannel"]:
    """jax.distributed.initialize (must run before anything touches a JAX backend); returns the
    step channel every process of the slice shares (None with one process)."""
    if not dist.enabled:
        return None
    if not dist.coordinator_address:
        raise ValueError("--num-processes > 1 needs --coordinator-address HOST:PORT (process 0's address)")
    if not 0 <= dist.process_id < dist.num_processes:
        raise ValueError(f"--process-id must be in [0, {dist.num_processes}), got {dist.process_id}")
    import jax  # heavy: jax (imported only once the slice is set up)

    # CPU collectives across processes need a transport; on GPU/TPU the platform provides one.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(dist.coordinator_address, num_processes=dist.num_processes,
                               process_id=dist.process_id)
    log.info("process %d of %d joined %s: %d global devices, %d local", dist.process_id, dist.num_processes,
             dist.coordinator_address, jax.device_count(), jax.local_device_count())
    return StepChannel(dist.process_id)


def encode(message: tuple) -> bytes:
    """JSON with numpy arrays as {"__nd__": [dtype, shape, base64]} and runner rows as
    {"__row__": [type, fields]}. Not pickle: whoever can reach the coordinator's port could
    otherwise run code on every follower."""
    def default(o: Any) -> Any:
        if is_dataclass(o) and type(o).__name__ in ROW_TYPES:
            return {"__row__": [type(o).__name__, {f.name: getattr(o, f.name) for f in fields(o)}]}
        if isinstance(o, np.ndarray):
            a = np.ascontiguousarray(o)
            dt = a.dtype.name if a.dtype.kind == "V" else a.dtype.str   # bfloat16's .str is '<V2': raw bytes
            return {"__nd__": [dt, list(a.shape), base64.b64encode(a.tobytes()).decode("ascii")]}
        if isinstance(o, np.generic):
            return o.item()
        raise TypeError(f"cannot publish a {type(o).__name__}")
    return json.dumps(message, default=default, separators=(",", ":")).encode()


def decode(data: bytes) -> tuple:
    def hook(d: dict) -> Any:
        if len(d) == 1 and "__nd__" in d:
            dtype, shape, b64 = d["__nd__"]
            return np.frombuffer(base64.b64decode(b64), dtype=np.dtype(dtype)).reshape(shape).copy()
        if len(d) == 1 and "__row__" in d:
            kind, values = d["__row__"]
            return ROW_TYPES[kind](**values)
        return d
    return tuple(json.loads(data, object_hook=hook))


class StepChannel:
    """An ordered log of runner calls in the coordination service's key-value store."""

    def __init__(self, process_id: int):
        from jax._src import distributed  # heavy: jax

        self.client = distributed.global_state.client
        self.process_id = process_id
        self.seq = 0
        self.lock = threading.Lock()    # publish + launch is atomic: one global launch order

    def publish(self, message: tuple) -> None:
        """Leader side; call with `lock` held."""
        self.client.key_value_set_bytes(f"{_PREFIX}{self.seq}", encode(message))
        if self.seq >= _KEEP:
            try:
                self.client.key_value_delete(f"{_PREFIX}{self.seq - _KEEP}")
            except Exception:  # pragma: no cover - best effort cleanup
                pass
        self.seq += 1

    def receive(self, poll_ms: int = 60_000) -> tuple:
        """Follower side: the next call, waiting as long as the leader is idle."""
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(f"{_PREFIX}{self.seq}", poll_ms)
            except Exception as e:
                if "DEADLINE_EXCEEDED" in str(e):
                    continue        # the leader is idle; keep waiting
                raise
            self.seq += 1
            return decode(data)

    def stop(self) -> None:
        with self.lock:
            self.publish((_STOP,))


def follow(runners: dict[str, Any], chan: StepChannel, on_call: Optional[Callable[[str, str], None]] = None) -> int:
    """Follower main loop: replay process 0's runner calls until it says stop. Returns the count."""
    n = 0
    while True:
        msg = chan.receive()
        if msg[0] == _STOP:
            log.info("process 0 stopped after %d steps; leaving", n)
            return n
        key, name, args = msg
        runner = runners.get(key)
        if runner is None or name not in MIRRORED:
            raise RuntimeError(f"process 0 called {key}.{name}, which this process does not have; "
                               "start every process with the same model flags")
        try:
            getattr(runner, name)(*args)
        except Exception as e:
            # The leader contains a failed step the same way (scheduler._step_failed: the step's
            # requests fail, a lost state is reset, and that reset is replayed here too).
            log.error("replaying %s.%s failed: %r", key, name, e)
        n += 1
        if on_call is not None:
            on_call(key, name)


def finalize(chan: Optional[StepChannel]) -> None:
    """Process 0: tell the followers to leave. Every process: leave the job together."""
    if chan is None:
        return
    import jax  # heavy: jax

    if chan.process_id == 0:
        chan.stop()
    try:
        jax.distributed.shutdown()
    except Exception as e:  # pragma: no cover - the peers may already be gone
        log.warning("jax.distributed.shutdown: %s", e)
