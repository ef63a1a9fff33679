"""Soak test: mixed traffic on both fronts for N minutes, then check that nothing leaked.

Unless --http and --grpc are given, it starts `xlaserve serve` itself (default engine settings,
the bundled models, free local ports; extra serve flags after `--`) and stops it with SIGTERM at
the end, which also checks that the drain exits 0.

Traffic: --concurrency client tasks, each picking at random, until the time is up:
  HTTP   /v1/completions, /v1/chat/completions (stream read to the end), /v1/embeddings, the JSON
         mirror's Generate (NDJSON); clients that cancel a stream after a few chunks, that time
         out (a client deadline of 20-500 ms), that crash (raw socket reset mid-stream), and
         bad requests (400s, which the engine never accepts);
  gRPC   SGLang Generate (read to the end, cancelled after a chunk, a 20-500 ms deadline,
         aborted by id from another call), Arctic Encode, AllSpark StartRequest + Get loop +
         Release (some stopped half-way).
Every client call has its own hard timeout; one that hits it counts as a hang (must be 0).

Checks at the end, once traffic has stopped and the server is idle again:
  * accounting balances: engine requests accepted == completed + errored + cancelled
    (xlaserve_engine_requests_total on /metrics);
  * KV pages in use are back to the baseline taken before the traffic;
  * the server's RSS is flat: the end sample is within max(10 %, 64 MiB) of the sample taken after
    a warm-up minute (the first minute, or 20 % of a short run, is warm-up);
  * no 5xx responses and no INTERNAL / UNKNOWN statuses, no hangs, and a normal request still
    succeeds.
Prints one JSON object (also written to --out).

Run:  python -m benchmarks.soak --minutes 10 [--concurrency 12] [--http URL --grpc ADDR --pid PID]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALL_TIMEOUT_S = 120.0     # a client call that takes longer than this is a hang
MIB = 1024 * 1024
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards "
         "quietly judge boxing matches under a pale violet sky near the old harbour").split()


# =============================================================================================
# the server
# =============================================================================================
class Server:
    """`xlaserve serve` in a subprocess (free ports); its log is kept in a temporary file."""

    def __init__(self, extra: Sequence[str]):
        fd, self.log_path = tempfile.mkstemp(prefix="xlaserve-soak-", suffix=".log")
        self.log = os.fdopen(fd, "w")      # the server's stdout for its whole life
        cmd = [sys.executable, "-m", "frontends.cli", "serve", "--grpc-port", "0", "--http-port", "0",
               "--log-level", "info", *extra]
        env = dict(os.environ, XLASERVE_PROGRESS="0")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.pid = self.proc.pid
        self.http = self.grpc = ""

    def text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float) -> float:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            log = self.text()
            http = re.search(r"HTTP listening on (http://\S+)", log)
            grpc_ = re.search(r"gRPC listening on (\S+?),? ", log)
            if http and grpc_:
                self.http, self.grpc = http.group(1), grpc_.group(1).rstrip(",")
                try:
                    if httpx.get(self.http + "/ready", timeout=5).status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready within {timeout:.0f}s:\n{self.text()[-3000:]}")

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return None
        return self.proc.returncode


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# =============================================================================================
# metrics
# =============================================================================================
def parse_metrics(text: str) -> dict[str, float]:
    """Sample name with labels -> value, e.g. 'xlaserve_engine_requests_total{outcome="accepted"}'."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def engine_counts(m: dict[str, float]) -> dict[str, int]:
    return {k: int(m.get(f'xlaserve_engine_requests_total{{outcome="{k}"}}', 0))
            for k in ("accepted", "completed", "errored", "cancelled")}


def summed(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix + "{") or k == prefix)


# =============================================================================================
# traffic
# =============================================================================================
class Stats:
    def __init__(self) -> None:
        self.actions: dict[str, int] = {}
        self.outcomes: dict[str, int] = {}
        self.server_errors: list[str] = []
        self.hangs: list[str] = []
        self.client_errors: dict[str, int] = {}

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class Traffic:
    def __init__(self, http: str, grpc_addr: str, gen_model: str, embed_model: str, vocab: int, seed: int):
        import grpc
        import httpx

        from frontends.grpc.gen.allspark import allspark_service_pb2 as apb
        from frontends.grpc.gen.allspark import allspark_service_pb2_grpc as apb_grpc
        from frontends.grpc.gen.arctic_inference import inference_pb2 as ipb
        from frontends.grpc.gen.arctic_inference import inference_pb2_grpc as ipb_grpc
        from frontends.grpc.gen.sglang import sglang_scheduler_pb2 as spb
        from frontends.grpc.gen.sglang import sglang_scheduler_pb2_grpc as spb_grpc

        self.grpc, self.apb, self.ipb, self.spb = grpc, apb, ipb, spb
        self.http_url = http
        self.host, self.port = re.match(r"https?://([^:/]+):(\d+)", http).groups()
        self.client = httpx.AsyncClient(base_url=http, timeout=httpx.Timeout(60.0),
                                        limits=httpx.Limits(max_connections=200, max_keepalive_connections=50))
        self.channel = grpc.aio.insecure_channel(grpc_addr)
        self.sglang = spb_grpc.SglangSchedulerStub(self.channel)
        self.arctic = ipb_grpc.InferenceServiceStub(self.channel)
        self.allspark = apb_grpc.AllSparkStub(self.channel)
        self.gen_model, self.embed_model, self.vocab = gen_model, embed_model, vocab
        self.rng = random.Random(seed)
        self.stats = Stats()

    async def close(self) -> None:
        await self.client.aclose()
        await self.channel.close()

    # ---------------------------------------------------------------- helpers
    def text(self, lo: int = 3, hi: int = 40) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def ids(self, lo: int = 4, hi: int = 120) -> list[int]:
        return [self.rng.randrange(3, min(self.vocab, 1000)) for _ in range(self.rng.randint(lo, hi))]

    def http_status(self, what: str, status: int, body: str = "") -> None:
        self.stats.count(self.stats.outcomes, f"http {status}")
        if status >= 500:
            self.stats.server_errors.append(f"{what}: HTTP {status} {body[:200]}")

    def grpc_code(self, what: str, code: Any, details: str = "") -> None:
        self.stats.count(self.stats.outcomes, f"grpc {code.name}")
        if code in (self.grpc.StatusCode.INTERNAL, self.grpc.StatusCode.UNKNOWN):
            self.stats.server_errors.append(f"{what}: {code.name} {details[:200]}")

    def sampling(self, max_new: int) -> Any:
        return self.spb.SamplingParams(temperature=self.rng.choice([0.0, 0.7, 1.0]), top_p=1.0, top_k=-1,
                                       repetition_penalty=1.0, n=1, max_new_tokens=max_new,
                                       ignore_eos=self.rng.random() < 0.7)

    # ---------------------------------------------------------------- HTTP actions
    async def http_completion(self) -> None:
        body = {"model": self.gen_model, "prompt": self.text(), "max_tokens": self.rng.randint(1, 32),
                "temperature": self.rng.choice([0, 0.8]), "n": self.rng.choice([1, 1, 2])}
        r = await self.client.post("/v1/completions", json=body)
        self.http_status("completion", r.status_code, r.text)

    async def http_chat_stream(self, cancel_after: int | None = None) -> None:
        body = {"model": self.gen_model, "messages": [{"role": "user", "content": self.text()}],
                "max_tokens": self.rng.randint(8, 64), "stream": True, "ignore_eos": True}
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if '"error"' in line and '"internal' in line:
                        self.stats.server_errors.append(f"chat stream error event: {line[:200]}")
                    if cancel_after is not None and chunks >= cancel_after:
                        break  # leaving the context closes the connection: a client cancel
            self.http_status("chat stream", r.status_code)

    async def http_timeout(self) -> None:
        import httpx

        body = {"model": self.gen_model, "prompt": self.text(), "max_tokens": self.rng.randint(32, 128),
                "ignore_eos": True, "stream": self.rng.random() < 0.5}
        try:
            r = await self.client.post("/v1/completions", json=body,
                                       timeout=httpx.Timeout(self.rng.uniform(0.02, 0.5)))
            self.http_status("timeout completion", r.status_code, r.text)
        except httpx.TimeoutException:
            self.stats.count(self.stats.outcomes, "http client timeout")

    async def http_embeddings(self) -> None:
        body = {"model": self.embed_model, "input": [self.text() for _ in range(self.rng.randint(1, 8))]}
        r = await self.client.post("/v1/embeddings", json=body)
        self.http_status("embeddings", r.status_code, r.text)

    async def http_bad(self) -> None:
        body = self.rng.choice([{"prompt": ""}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "n": 10**6},
                                {"prompt": "x", "temperature": -1}, {"messages": []}])
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = await self.client.post(route, json=body)
        self.http_status("bad request", r.status_code, r.text)
        if r.status_code != 400:
            self.stats.server_errors.append(f"bad request answered {r.status_code}: {r.text[:200]}")

    async def http_mirror_stream(self) -> None:
        body = {"requestId": f"soak-m-{uuid.uuid4().hex}", "tokenized": {"inputIds": self.ids()}, "stream": True,
                "samplingParams": {"temperature": 0, "maxNewTokens": self.rng.randint(4, 48), "ignoreEos": True}}
        cut = self.rng.random() < 0.3
        async with self.client.stream("POST", "/sglang.grpc.scheduler.SglangScheduler/Generate", json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                n += 1
                if '"error"' in line and '"internal' in line:
                    self.stats.server_errors.append(f"mirror stream error: {line[:200]}")
                if cut and n >= 2:
                    break
            self.http_status("mirror stream", r.status_code)

    async def http_crash(self) -> None:
        """A client that dies mid-stream: raw socket, a few bytes read, then a TCP reset."""
        payload = json.dumps({"model": self.gen_model, "prompt": self.text(), "max_tokens": 128,
                              "ignore_eos": True, "stream": True}).encode()
        reader, writer = await asyncio.open_connection(self.host, int(self.port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        await writer.drain()
        await asyncio.wait_for(reader.read(self.rng.randint(50, 600)), 30)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        self.stats.count(self.stats.outcomes, "http client crash")

    # ---------------------------------------------------------------- gRPC actions
    def generate_request(self, max_new: int, rid: str | None = None) -> Any:
        return self.spb.GenerateRequest(request_id=rid or f"soak-{uuid.uuid4().hex}", stream=True,
                                        tokenized=self.spb.TokenizedInput(input_ids=self.ids()),
                                        sampling_params=self.sampling(max_new))

    async def grpc_generate(self, mode: str) -> None:
        grpc = self.grpc
        timeout = self.rng.uniform(0.02, 0.5) if mode == "deadline" else 60.0
        call = self.sglang.Generate(self.generate_request(self.rng.randint(4, 64)), timeout=timeout)
        try:
            async for msg in call:
                if mode == "cancel" and msg.WhichOneof("response") == "chunk":
                    call.cancel()
                    break
            code = grpc.StatusCode.CANCELLED if mode == "cancel" else await call.code()
            self.grpc_code(f"Generate ({mode})", code, await call.details() if code != grpc.StatusCode.CANCELLED else "")
        except grpc.aio.AioRpcError as e:
            self.grpc_code(f"Generate ({mode})", e.code(), e.details() or "")
        except asyncio.CancelledError:
            self.grpc_code(f"Generate ({mode})", grpc.StatusCode.CANCELLED)

    async def grpc_abort_by_id(self) -> None:
        rid = f"soak-abort-{uuid.uuid4().hex}"
        call = self.sglang.Generate(self.generate_request(128, rid), timeout=60)
        try:
            async for msg in call:
                await self.sglang.Abort(self.spb.AbortRequest(request_id=rid), timeout=10)
                if msg.WhichOneof("response") == "complete":
                    break
            self.grpc_code("Generate (aborted by id)", await call.code())
        except self.grpc.aio.AioRpcError as e:
            self.grpc_code("Generate (aborted by id)", e.code(), e.details() or "")

    async def grpc_encode(self) -> None:
        n = self.rng.randint(1, 8)
        resp = await self.arctic.Encode(self.ipb.EncodeRequest(request_id=uuid.uuid4().hex, n_prompts=n,
                                                              prompts=[self.text() for _ in range(n)],
                                                              model_name=self.embed_model), timeout=60)
        self.grpc_code("Encode", self.grpc.StatusCode.OK)
        if resp.error:
            self.stats.count(self.stats.outcomes, "arctic in-band error")
            if "internal" in resp.error.lower():
                self.stats.server_errors.append(f"Encode in-band: {resp.error[:200]}")

    async def grpc_allspark(self) -> None:
        apb = self.apb
        uid = f"soak-as-{uuid.uuid4().hex}"
        ids = self.ids(4, 60)
        import numpy as np

        t = apb.Tensor(name="input_ids", shape=apb.Tensor.Shape(dims=[1, len(ids)]),
                       device_type=apb.DeviceType(dev_type=apb.CPU), data_type=apb.INT64, data_mode=apb.DENSE,
                       data=np.asarray(ids, "<i8").tobytes())
        cfg = apb.GenerateConfig(do_sample=False, num_beams=1, num_return_sequences=1, temperature=1.0, top_k=50,
                                 top_p=1.0, repetition_penalty=1.0, max_length=len(ids) + self.rng.randint(2, 40),
                                 uuid=uid, seed=1)
        resp = await self.allspark.StartRequest(apb.StartRequestRequest(
            model_name=self.gen_model, inputs=apb.TensorMap(tensor_map={"input_ids": t}), config=cfg), timeout=30)
        if resp.as_status != apb.ALLSPARK_SUCCESS:
            self.stats.count(self.stats.outcomes, f"allspark status {resp.as_status}")
            return
        stop_early = self.rng.random() < 0.3
        try:
            for step in range(200):
                status = (await self.allspark.GenerateStatus(apb.UUID(uuid=uid), timeout=30)).status
                if status in (apb.GenerateFinished, apb.GenerateInterrupted):
                    name = "Finished" if status == apb.GenerateFinished else "Interrupted"
                    self.stats.count(self.stats.outcomes, f"allspark {name}{' (stopped)' if stop_early else ''}")
                    break
                await self.allspark.Get(apb.UUID(uuid=uid), timeout=30)
                if stop_early and step == 1:
                    await self.allspark.StopRequest(apb.StopRequestRequest(uuid=uid), timeout=30)
        finally:
            await self.allspark.ReleaseRequest(apb.StopRequestRequest(uuid=uid), timeout=30)

    # ---------------------------------------------------------------- the mix
    ACTIONS = (
        ("http completion", 10), ("http chat stream", 10), ("http chat stream cancelled", 6),
        ("http timeout", 6), ("http embeddings", 6), ("http bad request", 3), ("http mirror stream", 5),
        ("http crash", 4), ("grpc generate", 10), ("grpc generate cancelled", 6), ("grpc generate deadline", 6),
        ("grpc abort by id", 3), ("grpc encode", 6), ("grpc allspark", 6),
    )

    def pick(self) -> str:
        names, weights = zip(*self.ACTIONS)
        return self.rng.choices(names, weights)[0]

    async def run_one(self, name: str) -> None:
        fn = {
            "http completion": self.http_completion,
            "http chat stream": self.http_chat_stream,
            "http chat stream cancelled": lambda: self.http_chat_stream(cancel_after=self.rng.randint(1, 4)),
            "http timeout": self.http_timeout,
            "http embeddings": self.http_embeddings,
            "http bad request": self.http_bad,
            "http mirror stream": self.http_mirror_stream,
            "http crash": self.http_crash,
            "grpc generate": lambda: self.grpc_generate("full"),
            "grpc generate cancelled": lambda: self.grpc_generate("cancel"),
            "grpc generate deadline": lambda: self.grpc_generate("deadline"),
            "grpc abort by id": self.grpc_abort_by_id,
            "grpc encode": self.grpc_encode,
            "grpc allspark": self.grpc_allspark,
        }[name]
        self.stats.count(self.stats.actions, name)
        try:
            await asyncio.wait_for(fn(), CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.stats.hangs.append(name)
        except Exception as e:  # noqa: BLE001 -- a transport error is a client-side event, not a server failure
            key = f"{name}: {type(e).__name__}"
            self.stats.count(self.stats.client_errors, key)

    async def worker(self, until: float) -> None:
        while time.monotonic() < until:
            await self.run_one(self.pick())


# =============================================================================================
# the run
# =============================================================================================
async def fetch_metrics(client) -> dict[str, float]:
    r = await client.get("/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


async def wait_idle(client, timeout: float = 120.0) -> dict[str, float]:
    """Metrics once no engine request is in flight and nothing runs or waits."""
    deadline = time.monotonic() + timeout
    m: dict[str, float] = {}
    while time.monotonic() < deadline:
        m = await fetch_metrics(client)
        c = engine_counts(m)
        busy = summed(m, "xlaserve_running_requests") + summed(m, "xlaserve_waiting_requests")
        if c["accepted"] == c["completed"] + c["errored"] + c["cancelled"] and busy == 0:
            return m
        await asyncio.sleep(0.5)
    return m


async def soak(args: argparse.Namespace, http: str, grpc_addr: str, pid: int | None) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(base_url=http, timeout=30) as probe:
        models = (await probe.get("/v1/models")).json()["data"]
        gen = next(m for m in models if m["task"] == "generate")
        embed = next(m for m in models if m["task"] == "embed")
        info = await probe.post("/sglang.grpc.scheduler.SglangScheduler/GetModelInfo", json={})
        vocab = int(info.json().get("vocabSize", 1000)) if info.status_code == 200 else 1000
        traffic = Traffic(http, grpc_addr, gen["id"], embed["id"], vocab, args.seed)
        m0 = await wait_idle(probe)
        base_pages = summed(m0, "xlaserve_kv_pages_used")
        base_counts = engine_counts(m0)
        t_start = time.monotonic()
        duration = args.minutes * 60.0
        warmup = min(60.0, 0.2 * duration)
        rss_samples: list[tuple[float, int]] = []

        async def sample_rss() -> None:
            while time.monotonic() - t_start < duration:
                if pid:
                    rss_samples.append((round(time.monotonic() - t_start, 1), rss_bytes(pid)))
                await asyncio.sleep(10.0)

        sampler = asyncio.ensure_future(sample_rss())
        until = t_start + duration
        await asyncio.gather(*(traffic.worker(until) for _ in range(args.concurrency)))
        sampler.cancel()
        traffic_s = time.monotonic() - t_start
        await wait_idle(probe)
        idle_s = time.monotonic() - t_start - traffic_s
        if pid:
            rss_samples.append((round(time.monotonic() - t_start, 1), rss_bytes(pid)))
        # a normal request still works
        after = await probe.post("/v1/completions", json={"model": gen["id"], "prompt": "after the soak",
                                                          "max_tokens": 4})
        ready = (await probe.get("/ready")).status_code
        m2 = await wait_idle(probe)
        await traffic.close()

    counts = engine_counts(m2)
    delta = {k: counts[k] - base_counts[k] for k in counts}
    balanced = counts["accepted"] == counts["completed"] + counts["errored"] + counts["cancelled"]
    pages_end = summed(m2, "xlaserve_kv_pages_used")
    result: dict[str, Any] = {
        "minutes": args.minutes, "concurrency": args.concurrency, "seed": args.seed,
        "traffic_seconds": round(traffic_s, 1), "seconds_to_idle_after_traffic": round(idle_s, 1),
        "actions": dict(sorted(traffic.stats.actions.items())),
        "client_outcomes": dict(sorted(traffic.stats.outcomes.items())),
        "client_side_errors": dict(sorted(traffic.stats.client_errors.items())),
        "hangs": len(traffic.stats.hangs), "hang_examples": traffic.stats.hangs[:5],
        "server_errors": len(traffic.stats.server_errors), "server_error_examples": traffic.stats.server_errors[:5],
        "engine_requests_during_soak": delta, "engine_requests_total": counts, "accounting_balanced": balanced,
        "kv_pages_used_baseline": base_pages, "kv_pages_used_end": pages_end,
        "pages_back_to_baseline": pages_end == base_pages,
        "normal_request_after": after.status_code, "ready_after": ready,
        "compilations_after_warmup": summed(m2, "xlaserve_compilations_after_warmup_total"),
    }
    if pid and rss_samples:
        after_warmup = [s for s in rss_samples if s[0] >= warmup] or rss_samples
        start_rss, end_rss = after_warmup[0][1], rss_samples[-1][1]
        allowed = max(0.10 * start_rss, 64 * MIB)
        result.update({
            "server_pid": pid, "rss_first_mib": round(rss_samples[0][1] / MIB, 1),
            "rss_start_mib": round(start_rss / MIB, 1), "rss_end_mib": round(end_rss / MIB, 1),
            "rss_max_mib": round(max(s[1] for s in rss_samples) / MIB, 1),
            "rss_growth_mib": round((end_rss - start_rss) / MIB, 1), "rss_allowed_growth_mib": round(allowed / MIB, 1),
            "rss_flat": end_rss - start_rss <= allowed,
            "rss_samples_mib": [(t, round(v / MIB, 1)) for t, v in rss_samples],
        })
    result["ok"] = bool(balanced and result["pages_back_to_baseline"] and not traffic.stats.hangs
                        and not traffic.stats.server_errors and after.status_code == 200 and ready == 200
                        and result.get("rss_flat", True) and delta["accepted"] > 0)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long to drive traffic (default 10)")
    p.add_argument("--concurrency", type=int, default=12, help="client tasks (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http", help="a running server's HTTP base URL (else one is started)")
    p.add_argument("--grpc", help="a running server's gRPC address host:port")
    p.add_argument("--pid", type=int, help="the running server's pid (for RSS)")
    p.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds to wait for a started server")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    server = None
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        if args.http and args.grpc:
            http, grpc_addr, pid = args.http.rstrip("/"), args.grpc, args.pid
        else:
            server = Server(extra)
            print(f"starting xlaserve serve (log: {server.log_path})", file=sys.stderr)
            ready_s = server.wait_ready(args.ready_timeout)
            print(f"ready after {ready_s:.0f}s; soaking for {args.minutes:g} minute(s)", file=sys.stderr)
            http, grpc_addr, pid = server.http, server.grpc, server.pid
        result = asyncio.run(soak(args, http, grpc_addr, pid))
        if server is not None:
            result["server_ready_seconds"] = round(ready_s, 1)
    finally:
        if server is not None:
            code = server.stop()
    if server is not None:
        result["server_exit_code_after_sigterm"] = code
        result["ok"] = result["ok"] and code == 0
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
