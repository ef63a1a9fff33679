"""Tensor parallelism and replicas on CPU with forced host devices (run in a subprocess,
because the device count is fixed when JAX initialises)."""
import json
import os
import subprocess
import sys

import numpy as np


def test_tp_and_replicas_match_single_device():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/engine/ -> repo
    out = subprocess.run([sys.executable, "-m", "tests.helpers.tp_script"], cwd=root, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
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
