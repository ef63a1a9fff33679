"""The newer decoder families and a LoRA adapter through `xlaserve serve` over HTTP: one server
process serving tiny random Phi-3 (LongRoPE), Gemma 2 (soft-capping, alternating windows),
Gemma 3 and Qwen2 with YaRN, plus a PEFT adapter on the first of them; 16 greedy tokens of each
equal transformers' (and peft's) `generate`. The in-process parity tests are in
tests/engine/test_decoder.py and tests/engine/test_lora.py; this checks the served path (CLI flags,
model table, OpenAI route, adapter-as-model) end to end."""
from __future__ import annotations

import os
import subprocess
import threading

import httpx
import pytest

from tests.helpers import hf_models
from tests.helpers.shared import wait_for, xlaserve

FAMILIES = ["phi3", "gemma2", "gemma3", "qwen2_yarn"]
PROMPT = list(range(3, 40))
N = 16


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    refs = {f: hf_models.build(f, str(root / f)) for f in FAMILIES}
    adapter = hf_models.build_lora(refs["phi3"], str(root / "phi3-lora"), seed=7, r=4,
                                   targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    from transformers import AutoTokenizer

    def text(model, folder) -> str:    # the answer as the server's detokenizer writes it (special tokens skipped)
        return AutoTokenizer.from_pretrained(str(root / folder)).decode(hf_models.hf_greedy(model, PROMPT, N),
                                                                          skip_special_tokens=True)
    want = {f: text(m, f) for f, m in refs.items()}
    want["phi3-lora"] = text(adapter, "phi3")
    cmd = xlaserve() + ["serve", "--grpc-port", "0", "--http-port", "0", "--log-level", "info",
                        "--max-running-requests", "2", "--max-num-batched-tokens", "32", "--page-size", "16",
                        "--num-pages", "32", "--max-model-len", "128", "--max-lora-rank", "8", "--max-loras", "1",
                        "--lora", f"phi3-lora={root / 'phi3-lora'}",
                        # the C++ kernels forced (no start-up measurement: the chooser has its own tests) and
                        # no burst buckets: 4 models' start-up was 3 of CI's 30 minutes
                        "--cpu-matmul", "kernel", "--burst-batched-tokens", "0"]
    for f in FAMILIES:
        cmd += ["--model", f"{f}={root / f}"]
    env = {**os.environ, "XLASERVE_PROGRESS": "0"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(r.decode(errors="replace").rstrip()) for r in proc.stdout],
                     daemon=True).start()
    url = None

    def listening() -> bool:
        nonlocal url
        url = next((ln.split("HTTP listening on ")[1].split()[0] for ln in lines if "HTTP listening on " in ln), None)
        return url is not None or proc.poll() is not None
    try:
        assert wait_for(listening, 300, 0.2) and proc.poll() is None, "\n".join(lines[-40:])
        with httpx.Client(base_url=url, timeout=60) as c:
            assert wait_for(lambda: c.get("/ready").status_code == 200, 600, 0.5), "\n".join(lines[-40:])
            yield c, want
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("model", FAMILIES + ["phi3-lora"])
def test_greedy_tokens_over_http_equal_transformers(zoo, model):
    client, want = zoo
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N, "min_tokens": N,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model and body["usage"]["completion_tokens"] == N
    assert body["choices"][0]["text"] == want[model], f"{model}: the served greedy answer differs from transformers'"
    if model == "phi3-lora":
        assert want["phi3-lora"] != want["phi3"], "the adapter must change the answer"
