"""Two `xlaserve serve` processes on loopback form one TP=2 mesh (one CPU device each, gloo
collectives, jax.distributed); process 0 serves the fronts, process 1 follows its steps.

Their greedy tokens must equal a single process's (the in-process engine at TP 1) and
transformers' `generate`. SIGTERM to process 0 then stops both with exit code 0.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import threading

import grpc
import pytest

from jax_engine.config import ModelSpec
from jax_engine.decode.runner import MIRRORED, mirrored
from jax_engine.engine import Engine
from tests.helpers import hf_models
from tests.helpers.engines import PROMPTS, greedy_all, small_args
from tests.helpers.shared import fast_compile_xla_flags, wait_for, xlaserve

NEW_TOKENS = 12
FLAGS = ["--max-running-requests", "4", "--max-num-batched-tokens", "16", "--max-model-len", "128",
         "--page-size", "8", "--num-pages", "64", "--max-n", "1", "--max-top-logprobs", "1",
         # XLA's dot (no kernel build or matmul measurement in each process) and no burst buckets: the
         # mesh, not the CPU kernels, is under test; budget 16: 5 token buckets to compile, prompts in chunks
         "--cpu-matmul", "xla", "--burst-batched-tokens", "0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())

    def find(self, text: str):
        return next((ln for ln in list(self.lines) if text in ln), None)

    def log(self) -> str:
        return "\n".join(self.lines[-40:])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2_mh"))
    torch_model = hf_models.build("qwen2", path)    # 2 KV heads: one per process at TP 2
    return path, torch_model


def test_two_processes_form_one_tp2_mesh_and_match_one_process(model_path, tmp_path):
    path, torch_model = model_path
    expected_hf = [hf_models.hf_greedy(torch_model, p, NEW_TOKENS) for p in PROMPTS]
    single = Engine(small_args(models=[ModelSpec(name="m", path=path)]))
    single.load_all(progress=False, warmup=False)
    try:
        expected = asyncio.run(greedy_all(single, PROMPTS, NEW_TOKENS))
    finally:
        single.shutdown()
    assert expected == expected_hf

    env = dict(os.environ, XLASERVE_PROGRESS="0", JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path),
               XLA_FLAGS=fast_compile_xla_flags("--xla_force_host_platform_device_count=1"))
    coord = f"127.0.0.1:{_free_port()}"
    common = ["serve", "--model", f"m={path}", "--tp", "2", "--coordinator-address", coord,
              "--num-processes", "2", "--grpc-port", "0", "--http-port", "0", *FLAGS]
    procs = [Proc(xlaserve() + common + ["--process-id", str(i)], env) for i in (0, 1)]
    try:
        lead, follower = procs
        assert wait_for(lambda: lead.find("ready in") or lead.proc.poll() is not None, 420, 0.5), lead.log()
        assert lead.proc.poll() is None, lead.log()
        assert wait_for(lambda: follower.find("following process 0 for m/0"), 60, 0.5), follower.log()
        # one mesh over both processes' devices (process 1's CPU device ids start at 2048)
        assert "mesh data=1 x model=2" in (lead.find("model m: ") or ""), lead.log()
        assert "devices cpu:0,cpu:2048" in lead.find("model m: "), lead.log()
        addr = lead.find("gRPC listening on").split("gRPC listening on ")[1].split(",")[0].split(" ")[0]

        from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as pb
        from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as pbg

        def generate(i: int, prompt: list[int]) -> list[int]:
            sp = pb.SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            req = pb.GenerateRequest(request_id=f"mh{i}", tokenized=pb.TokenizedInput(input_ids=prompt),
                                     sampling_params=sp, stream=False)
            with grpc.insecure_channel(addr) as ch:
                msgs = list(pbg.SglangSchedulerStub(ch).Generate(req, timeout=120))
            return list(msgs[-1].complete.output_ids)

        got: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i, p=p: got.__setitem__(i, generate(i, p)))
                   for i, p in enumerate(PROMPTS)]     # concurrent: batched decode across the mesh
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [got.get(i) for i in range(len(PROMPTS))] == expected, lead.log() + "\n---\n" + follower.log()

        lead.proc.send_signal(signal.SIGTERM)
        assert lead.proc.wait(120) == 0, lead.log()
        assert follower.proc.wait(60) == 0, follower.log()
        steps = re.search(r"process 0 stopped after (\d+) steps", follower.find("process 0 stopped after") or "")
        assert steps and int(steps.group(1)) >= NEW_TOKENS, follower.log()   # it replayed every decode step
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(10)


# ------------------------------------------------------------------------ in-process units
class _FakeChannel:
    def __init__(self):
        self.lock = threading.Lock()
        self.log: list[tuple] = []

    def publish(self, message: tuple) -> None:
        assert self.lock.locked()           # publish and launch happen under one lock
        self.log.append(message)

    def receive(self) -> tuple:
        return self.log.pop(0)


class _EncodingChannel(_FakeChannel):
    """Publishes the bytes StepChannel would store (multihost.encode) and receives them decoded."""

    def publish(self, message: tuple) -> None:
        from jax_engine.executor import multihost

        super().publish(multihost.encode(message))

    def receive(self) -> tuple:
        from jax_engine.executor import multihost

        return multihost.decode(self.log.pop(0))


class _Runner:
    """Two device calls marked like ModelRunner's, and one host-side method."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.mirror = None

    @mirrored
    def step(self, rows, greedy):
        self.calls.append(("step", rows, greedy))
        return "tokens"

    @mirrored
    def set_slot(self, slot, prompt_ids, output_ids):
        self.calls.append(("set_slot", slot, prompt_ids, output_ids))

    def state_lost(self):
        return False


def _rows():
    """A decode row (numpy ints, as the scheduler's token lists hold after a step) and the chunk
    that ends an n = 2 prompt, the second fork with every sampling setting."""
    import numpy as np

    from jax_engine.decode.rows import SampleRow, SamplingRow, StepRow

    decode = StepRow(tokens=[np.int64(7)], start=np.int32(12), pages=[np.int64(1), 2],
                     samples=[SampleRow(np.int32(0), SamplingRow(steps=np.int64(3)))])
    fork = SamplingRow(temperature=0.7, top_k=np.int32(40), top_p=0.9, min_p=0.05, rep_pen=1.1, freq_pen=0.2,
                       pres_pen=-0.5, seeds=2 ** 64 - 1, steps=0, bias=[(3, -1.5), (np.int32(9), 2.0)], ban=[2, 5])
    chunk = StepRow(tokens=[5, 6, np.int32(7)], start=8, pages=[3, 4],
                    samples=[SampleRow(1, SamplingRow(temperature=0.7, seeds=11)), SampleRow(2, fork)])
    middle = StepRow(tokens=[1, 2], start=0, pages=[5])     # a chunk that does not end its prompt
    return [decode, chunk, middle]


def test_leader_publishes_each_device_call_and_follower_replays_it():
    from jax_engine.decode.rows import SampleRow, SamplingRow, StepRow
    from jax_engine.executor import multihost

    chan = _FakeChannel()
    leader_side, follower_side = _Runner(), _Runner()
    leader_side.mirror = (chan, "m/0")                          # as GenerateWorker does on process 0
    rows = [StepRow(tokens=[1], start=4, pages=[1], samples=[SampleRow(0, SamplingRow())])]
    assert leader_side.step(rows, True) == "tokens"
    leader_side.set_slot(3, [1, 2], [])
    assert leader_side.state_lost() is False                    # host-side: not published
    assert [m[:2] for m in chan.log] == [("m/0", "step"), ("m/0", "set_slot")]
    chan.log.append(("__stop__",))
    assert multihost.follow({"m/0": follower_side}, chan) == 2
    assert follower_side.calls == leader_side.calls


def test_a_follower_replays_published_step_rows_through_the_wire_format():
    from jax_engine.decode.rows import StepRow
    from jax_engine.executor import multihost

    chan = _EncodingChannel()
    leader_side, follower_side = _Runner(), _Runner()
    leader_side.mirror = (chan, "m/0")
    rows = _rows()
    rows[1].samples[1].sampling.bias = [[3, -1.5], [9, 2.0]]   # JSON has no tuples: compare as lists
    leader_side.step(rows, False)
    leader_side.set_slot(3, [1, 2], [4])
    assert all(isinstance(m, bytes) for m in chan.log)
    chan.log.append(multihost.encode(("__stop__",)))
    assert multihost.follow({"m/0": follower_side}, chan) == 2
    assert follower_side.calls == leader_side.calls             # dataclass equality, nested
    got = follower_side.calls[0][1]
    assert all(type(r) is StepRow for r in got) and got[1].samples[1].sampling.seeds == 2 ** 64 - 1


def test_every_device_call_of_the_runner_is_mirrored():
    from jax_engine.decode.runner import ModelRunner

    assert set(MIRRORED) == {"step", "prompt_logprobs", "copy_page", "set_slot", "reset_state", "write_lora_slot"}
    assert not {"decode", "prefill", "first_tokens"} & set(MIRRORED)
    assert all(hasattr(getattr(ModelRunner, m), "__wrapped__") for m in MIRRORED)


def test_published_calls_round_trip_exactly_and_are_not_pickle():
    import numpy as np

    from jax_engine.executor import multihost

    h = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    msg = ("m/0", "prompt_logprobs", (h[1:4], [np.int32(4), 5, np.int64(6)], np.int64(3)))
    data = multihost.encode(msg)
    assert not data.startswith(b"\x80")            # JSON, not a pickle stream
    key, name, (h2, nxt2, n2) = multihost.decode(data)
    assert (key, name) == ("m/0", "prompt_logprobs") and nxt2 == [4, 5, 6] and n2 == 3
    assert all(type(t) is int for t in nxt2) and type(n2) is int
    assert h2.dtype == np.float32 and h2.shape == (3, 8) and np.array_equal(h2, h[1:4])
    key, name, args = multihost.decode(multihost.encode(("m/0", "copy_page", (np.int32(3), np.int64(9)))))
    assert (name, args) == ("copy_page", [3, 9])
    with pytest.raises(TypeError, match="cannot publish"):
        multihost.encode(("m/0", "step", (object(),)))


def test_bfloat16_hidden_rows_round_trip():
    import ml_dtypes
    import numpy as np

    from jax_engine.executor import multihost

    h = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    _, _, (h2, _, _) = multihost.decode(multihost.encode(("m/0", "prompt_logprobs", (h, [1], 2))))
    assert h2.dtype == h.dtype and np.array_equal(h2, h)


def test_typed_runner_rows_round_trip_as_their_types():
    import numpy as np

    from jax_engine.decode import sampling
    from jax_engine.decode.rows import SampleRow, SamplingRow, StepRow
    from jax_engine.decode.runner import NUM_BAN, NUM_BIAS
    from jax_engine.executor import multihost

    rows = _rows()
    key, name, (rows2, greedy) = multihost.decode(multihost.encode(("m/0", "step", (rows, False))))
    assert (key, name, greedy) == ("m/0", "step", False) and len(rows2) == 3
    for r, got in zip(rows, rows2):
        assert type(got) is StepRow and all(type(s) is SampleRow and type(s.sampling) is SamplingRow
                                            for s in got.samples)
        assert (got.tokens, got.start, got.pages) == (r.tokens, r.start, r.pages)
        assert all(type(t) is int for t in got.tokens + got.pages) and type(got.start) is int
        assert [s.slot_id for s in got.samples] == [s.slot_id for s in r.samples]
    assert rows2[2].samples == []
    fork = rows2[1].samples[1].sampling
    assert fork.bias == [[3, -1.5], [9, 2.0]] and fork.seeds == 2 ** 64 - 1 and fork.ban == [2, 5]
    assert (fork.temperature, fork.top_k, fork.top_p, fork.min_p) == (0.7, 40, 0.9, 0.05)
    assert (fork.rep_pen, fork.freq_pen, fork.pres_pen, fork.steps) == (1.1, 0.2, -0.5, 0)
    assert rows2[0].samples[0].sampling == SamplingRow(steps=3)
    # what the runner packs from them (sampling.host_arrays) is identical on both sides
    sent = [s.sampling for r in rows for s in r.samples]
    recv = [s.sampling for r in rows2 for s in r.samples]
    a, b = (sampling.host_arrays(x + [None], 4, NUM_BIAS, NUM_BAN) for x in (sent, recv))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
    # a speculating row: each verified position's index, guess and earlier guesses
    spec = StepRow(tokens=[7, 8, 9], start=5, pages=[1],
                   samples=[SampleRow(0, SamplingRow(steps=4 + j), at=j, draft=[8, 9, -1][j], prior=[8, 9][:j])
                            for j in range(3)])
    (got,) = multihost.decode(multihost.encode(("m/0", "step", ([spec], True))))[2][0]
    assert [(s.at, s.draft, s.prior, s.sampling.steps) for s in got.samples] == \
        [(0, 8, [], 4), (1, 9, [8], 5), (2, -1, [8, 9], 6)]


def test_a_failed_replay_is_contained_like_the_leaders_step():
    from jax_engine.executor import multihost

    class Failing(_Runner):
        def step(self, rows, greedy):
            raise RuntimeError("device fault")

    chan = _FakeChannel()
    chan.log += [("m/0", "step", ([], True)), ("m/0", "set_slot", (1, [2], [])), ("__stop__",)]
    follower = Failing()
    assert multihost.follow({"m/0": follower}, chan) == 2
    assert follower.calls == [("set_slot", 1, [2], [])]


def test_follower_refuses_a_call_for_a_model_it_does_not_have():
    from jax_engine.executor import multihost

    chan = _FakeChannel()
    chan.log.append(("other/0", "step", ([], True)))
    with pytest.raises(RuntimeError, match="same model flags"):
        multihost.follow({"m/0": _Runner()}, chan)

    chan.log.append(("m/0", "decode", ([], True)))              # a method of the old split design
    with pytest.raises(RuntimeError, match="same model flags"):
        multihost.follow({"m/0": _Runner()}, chan)


def test_flags_are_checked_and_runtime_loading_is_refused(tmp_path):
    from frontends.cli import parse_serve_args
    from jax_engine.errors import Unimplemented

    folder = tmp_path / "m"
    folder.mkdir()
    for bad in (["--num-processes", "2"], ["--num-processes", "2", "--coordinator-address", "h:1", "--process-id", "2"]):
        with pytest.raises(SystemExit):
            parse_serve_args(["--model", str(folder), *bad])
    ns = parse_serve_args(["--model", str(folder), "--num-processes", "2", "--coordinator-address", "h:1",
                           "--process-id", "1"])
    assert (ns.num_processes, ns.process_id, ns.coordinator_address) == (2, 1, "h:1")

    eng = Engine(small_args(model_root=str(tmp_path)), channel=_FakeChannel())
    with pytest.raises(Unimplemented, match="more than one process") as err:
        asyncio.run(eng.load_model(ModelSpec(name="x", path=str(folder))))
    from frontends.common.errors import AS_STATUS_BY_KIND, grpc_code, http_status

    assert (grpc_code(err.value), http_status(err.value)) == (grpc.StatusCode.UNIMPLEMENTED, 501)
    assert AS_STATUS_BY_KIND[err.value.kind] == 8
