"""Tensor parallelism and replicas on CPU with forced host devices (run in a subprocess,
because the device count is fixed when JAX initialises)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest


@pytest.fixture(scope="module")
def res():
    """One subprocess for every check here (tests/helpers/tp_script.py)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/engine/ -> repo
    out = subprocess.run([sys.executable, "-m", "tests.helpers.tp_script"], cwd=root, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_tp_and_replicas_match_single_device(res):
    base = res["1x1"]
    for key in ("2x1", "4x1", "2x2"):
        err = np.max(np.abs(np.array(res[key]["logits"]) - np.array(base["logits"])))
        assert err <= 1e-4, f"{key}: logits differ from TP=1 by {err:.2e}"
        assert res[key]["tokens"] == base["tokens"], f"{key}: greedy tokens differ from TP=1"
        err = np.max(np.abs(np.array(res[key]["lora_logits"]) - np.array(base["lora_logits"])))
        assert err <= 1e-4, f"{key}: LoRA logits differ from TP=1 by {err:.2e}"
        assert res[key]["lora_tokens"] == base["lora_tokens"], f"{key}: LoRA greedy tokens differ from TP=1"
    assert res["1x1"]["lora_tokens"] != res["1x1"]["tokens"][:len(res["1x1"]["lora_tokens"])], "the adapter changes nothing"
    assert len(set(res["2x2"]["devices"])) == 4, "2 replicas x TP 2 must use 4 distinct devices"
    assert all(n > 0 for n in res["2x2"]["per_replica"]), "both replicas must serve requests"


DENSE = ["phi3", "gemma2", "gemma3", "qwen2_yarn", "llama_dynamic"]     # tp_script.DENSE


@pytest.mark.parametrize("fam", DENSE)
def test_dense_families_tp2_match_transformers(res, fam):
    """Phi-3, Gemma 2 / 3, YaRN and dynamic NTK: TP 2 (weights really split over 2 devices) agrees with
    transformers on the same weights (prefill logits within 1e-4, as one device must; greedy tokens)."""
    assert sorted(res["dense"]) == sorted(DENSE)
    two = res["dense"][fam]
    assert two["qkv_shards"] == 2
    err = np.max(np.abs(np.array(two["logits"]) - np.array(two["hf_logits"])))
    assert err <= 1e-4, f"{fam}: TP 2 logits differ from transformers by {err:.2e}"
    assert two["tokens"] == two["hf_tokens"], f"{fam}: TP 2 greedy tokens differ from transformers"
