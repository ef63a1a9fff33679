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
from tests.helpers.shared import wait_for, xlaserve

NEW_TOKENS = 12
FLAGS = ["--max-running-requests", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128",
         "--page-size", "8", "--num-pages", "64", "--max-n", "1", "--max-top-logprobs", "1"]


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
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
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


class _Runner:
    """Two device calls marked like ModelRunner's, and one host-side method."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.mirror = None

    @mirrored
    def decode(self, rows, greedy):
        self.calls.append(("decode", rows, greedy))
        return "tokens"

    @mirrored
    def set_slot(self, slot, prompt_ids, output_ids):
        self.calls.append(("set_slot", slot, prompt_ids, output_ids))

    def state_lost(self):
        return False


def test_leader_publishes_each_device_call_and_follower_replays_it():
    from jax_engine.executor import multihost

    chan = _FakeChannel()
    leader_side, follower_side = _Runner(), _Runner()
    leader_side.mirror = (chan, "m/0")                          # as GenerateWorker does on process 0
    assert leader_side.decode([{"t": 1}], True) == "tokens"
    leader_side.set_slot(3, [1, 2], [])
    assert leader_side.state_lost() is False                    # host-side: not published
    assert [m[:2] for m in chan.log] == [("m/0", "decode"), ("m/0", "set_slot")]
    chan.log.append(("__stop__",))
    assert multihost.follow({"m/0": follower_side}, chan) == 2
    assert follower_side.calls == leader_side.calls


def test_every_device_call_of_the_runner_is_mirrored():
    from jax_engine.decode.runner import ModelRunner

    assert set(MIRRORED) == {"decode", "prefill", "first_tokens", "prompt_logprobs", "copy_page", "set_slot",
                             "reset_state"}
    assert all(hasattr(getattr(ModelRunner, m), "__wrapped__") for m in MIRRORED)


def test_published_calls_round_trip_exactly_and_are_not_pickle():
    import numpy as np

    from jax_engine.executor import multihost

    raw = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    row = {"token": np.int32(7), "pages": [np.int64(1), 2], "sampling": {"temperature": 0.5, "bias": [(3, -1.5)],
                                                                     "seeds": 2 ** 32 - 1, "ban": []}}
    msg = ("m/0", "first_tokens", (raw, [row], [np.int32(4)]))
    data = multihost.encode(msg)
    assert not data.startswith(b"\x80")            # JSON, not a pickle stream
    key, name, (raw2, rows2, slots2) = multihost.decode(data)
    assert (key, name) == ("m/0", "first_tokens") and slots2 == [4]
    assert raw2.dtype == np.float32 and np.array_equal(raw2, raw)
    assert rows2[0]["token"] == 7 and rows2[0]["pages"] == [1, 2]
    assert rows2[0]["sampling"]["bias"] == [[3, -1.5]] and rows2[0]["sampling"]["seeds"] == 2 ** 32 - 1
    with pytest.raises(TypeError, match="cannot publish"):
        multihost.encode(("m/0", "decode", (object(),)))


def test_typed_runner_rows_round_trip_as_their_types():
    import numpy as np

    from jax_engine.decode.rows import DecodeRow, SamplingRow
    from jax_engine.executor import multihost

    row = DecodeRow(token=np.int32(7), position=3, kv_slot=11, pages=[np.int64(1), 2], slot_id=0,
                    sampling=SamplingRow(temperature=0.5, bias=[(3, -1.5)], seeds=2 ** 64 - 1, ban=[2]))
    key, name, (rows2, greedy) = multihost.decode(multihost.encode(("m/0", "decode", ([row], False))))
    got = rows2[0]
    assert isinstance(got, DecodeRow) and isinstance(got.sampling, SamplingRow) and greedy is False
    assert (got.token, got.position, got.kv_slot, got.pages, got.slot_id) == (7, 3, 11, [1, 2], 0)
    assert got.sampling.bias == [[3, -1.5]] and got.sampling.seeds == 2 ** 64 - 1 and got.sampling.ban == [2]


def test_a_failed_replay_is_contained_like_the_leaders_step():
    from jax_engine.executor import multihost

    class Failing(_Runner):
        def decode(self, rows, greedy):
            raise RuntimeError("device fault")

    chan = _FakeChannel()
    chan.log += [("m/0", "decode", ([], True)), ("m/0", "set_slot", (1, [2], [])), ("__stop__",)]
    follower = Failing()
    assert multihost.follow({"m/0": follower}, chan) == 2
    assert follower.calls == [("set_slot", 1, [2], [])]


def test_follower_refuses_a_call_for_a_model_it_does_not_have():
    from jax_engine.executor import multihost

    chan = _FakeChannel()
    chan.log.append(("other/0", "decode", ([], True)))
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
