"""More than one host: one TP mesh over every process's devices, driven by process 0.

JAX is multi-controller: every process must launch the same programs, in the same order, with
the same host inputs. So process 0 runs the fronts and the schedulers as usual, and each of its
model runners is wrapped in a `LeaderRunner` that publishes every device-touching call (decode,
prefill, first tokens, ...) before making it. The other processes build the same decoder
runners (same flags, same checkpoint), compile the same buckets, and `follow` the published
calls one by one. The calls travel through the key-value store of JAX's own coordination
service (`jax.distributed`), not through a channel of ours.

A step's outputs are replicated over the mesh (runner.py constrains them), so process 0 reads
them from its own devices; followers never fetch anything.

Failure model: the processes are one job. If any process dies, the collectives of the others
cannot complete; JAX's coordination service notices the missing heartbeats and ends the job.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

log = logging.getLogger("xlaserve.multihost")

# Runner methods that launch device programs; everything else is host-side and stays local.
MIRRORED = ("decode", "prefill", "first_tokens", "prompt_logprobs", "copy_page", "set_slot", "reset_state")
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


_channel: Optional["StepChannel"] = None


def initialize(dist: DistributedArgs) -> None:
    """jax.distributed.initialize (must run before anything touches a JAX backend)."""
    global _channel
    if not dist.enabled:
        return
    if not dist.coordinator_address:
        raise ValueError("--num-processes > 1 needs --coordinator-address HOST:PORT (process 0's address)")
    if not 0 <= dist.process_id < dist.num_processes:
        raise ValueError(f"--process-id must be in [0, {dist.num_processes}), got {dist.process_id}")
    import jax

    # CPU collectives across processes need a transport; on GPU/TPU the platform provides one.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(dist.coordinator_address, num_processes=dist.num_processes,
                               process_id=dist.process_id)
    _channel = StepChannel(dist.process_id)
    log.info("process %d of %d joined %s: %d global devices, %d local", dist.process_id, dist.num_processes,
             dist.coordinator_address, jax.device_count(), jax.local_device_count())


def active() -> bool:
    return _channel is not None


def channel() -> "StepChannel":
    if _channel is None:
        raise RuntimeError("multihost.initialize was not called")
    return _channel


def encode(message: tuple) -> bytes:
    """JSON with numpy arrays as {"__nd__": [dtype, shape, base64]}. Not pickle: whoever can
    reach the coordinator's port could otherwise run code on every follower."""
    def default(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            a = np.ascontiguousarray(o)
            return {"__nd__": [a.dtype.str, list(a.shape), base64.b64encode(a.tobytes()).decode("ascii")]}
        if isinstance(o, np.generic):
            return o.item()
        raise TypeError(f"cannot publish a {type(o).__name__}")
    return json.dumps(message, default=default, separators=(",", ":")).encode()


def decode(data: bytes) -> tuple:
    def hook(d: dict) -> Any:
        if len(d) == 1 and "__nd__" in d:
            dtype, shape, b64 = d["__nd__"]
            return np.frombuffer(base64.b64decode(b64), dtype=np.dtype(dtype)).reshape(shape).copy()
        return d
    return tuple(json.loads(data, object_hook=hook))


class StepChannel:
    """An ordered log of runner calls in the coordination service's key-value store."""

    def __init__(self, process_id: int):
        from jax._src import distributed

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


class LeaderRunner:
    """A ModelRunner proxy on process 0: publishes each device call, then makes it."""

    def __init__(self, runner: Any, key: str, chan: StepChannel):
        self._runner, self._key, self._chan = runner, key, chan

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._runner, name)
        if name not in MIRRORED:
            return attr

        def call(*args: Any) -> Any:
            with self._chan.lock:
                self._chan.publish((self._key, name, args))
                return attr(*args)
        return call

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._runner, name, value)


def follow(runners: dict[str, Any], on_call: Optional[Callable[[str, str], None]] = None) -> int:
    """Follower main loop: replay process 0's runner calls until it says stop. Returns the count."""
    chan = channel()
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


def run_follower(args: Any) -> int:
    """Process i > 0: load and compile the decoders of `args` (EngineArgs), then follow process 0.

    Encoders are served by process 0 alone, on its own devices, so followers skip them. A first
    SIGTERM/SIGINT is only logged (the slice stops when process 0 does, after its drain); a
    second one ends this process at once.
    """
    import signal

    import jax

    from jax_engine.engine import Engine
    from jax_engine.models.registry import task_of
    from weights_convert.hf import read_config

    def on_signal(sig: int, _frame: Any) -> None:
        log.warning("signal %d: process %d follows process 0 and stops when it does; send again to kill",
                    sig, jax.process_index())
        signal.signal(sig, signal.SIG_DFL)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    engine = Engine(args)
    runners: dict[str, Any] = {}
    for spec in args.models:
        if (spec.task or task_of(read_config(spec.path))) != "generate":
            log.info("%s is an encoder: process 0 serves it alone", spec.name)
            continue
        engine.load_model_sync(spec, progress=False)
        runners.update(engine._workers[spec.name].local_runners)
    log.info("process %d ready: following process 0 for %s", jax.process_index(), ", ".join(runners) or "nothing")
    follow(runners)
    finalize()
    return 0


def finalize() -> None:
    """Process 0: tell the followers to leave. Every process: leave the job together."""
    global _channel
    if _channel is None:
        return
    import jax

    if _channel.process_id == 0:
        _channel.stop()
    _channel = None
    try:
        jax.distributed.shutdown()
    except Exception as e:  # pragma: no cover - the peers may already be gone
        log.warning("jax.distributed.shutdown: %s", e)
