"""benchmarks/train_tiny.py's pieces on a toy configuration (seconds): the optimizer lowers the
loss, the saved folder is read by transformers' LlamaForCausalLM with the script's own logits,
the tokenizer is one id per byte, and the stdlib split is disjoint and deterministic."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import train_tiny as T

TOY = T.ModelConfig(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, context=32, max_positions=64)


def _stream(n: int = 6000) -> np.ndarray:
    # a periodic byte-range stream: learnable in a few steps
    return (np.arange(n) * 7 % 50 + 6).astype(np.int32)


def test_training_lowers_the_loss_and_is_deterministic():
    tc = T.TrainConfig(steps=12, batch=4, peak_lr=1e-2, warmup=2, eval_windows=8)
    stream = _stream()
    params, report = T.train(TOY, tc, stream, stream, minutes=5.0, log_every=3)
    assert report["steps_done"] == 12 and report["stopped_by"] == "steps"
    losses = [c["train_loss"] for c in report["curve"]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert report["heldout_loss_final"] < report["heldout_loss_initial"] - 0.5
    again, _ = T.train(TOY, tc, stream, stream, minutes=5.0, log_every=3)
    for x, y in zip(T.to_hf(params, TOY).values(), T.to_hf(again, TOY).values()):
        np.testing.assert_array_equal(x, y)


def test_saved_folder_loads_in_transformers_with_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, LlamaForCausalLM

    params = T.init_params(TOY, seed=3)
    # non-trivial norms, so a mix-up of the two layer norms would show
    params["layers"]["attn_norm"] = params["layers"]["attn_norm"] * 1.5
    params["norm"] = params["norm"] * 0.7
    path = str(tmp_path)
    ids = T.write_tokenizer(path, TOY)
    T.save_weights(path, params, TOY, ids)

    back = T.load_weights(path, TOY)
    for x, y in zip(T.to_hf(params, TOY).values(), T.to_hf(back, TOY).values()):
        np.testing.assert_array_equal(x, y)

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    for n in (1, 9, TOY.context):
        seq = rng.integers(0, TOY.vocab_size, n).tolist()
        ours = np.asarray(T.forward(params, TOY, np.asarray([seq], np.int32))[0])
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0].numpy()
        assert float(np.max(np.abs(ours - ref))) <= 1e-4

    tok = AutoTokenizer.from_pretrained(path)
    text = "def f(x):\n    return 'é'\n"
    assert len(tok) == TOY.vocab_size
    assert len(tok.encode(text, add_special_tokens=False)) == len(text.encode())
    assert np.array_equal(T.tokenize_stream(path, [("", text)], ids["<|eos|>"])[:-1],
                          tok.encode(text, add_special_tokens=False))


def test_stdlib_split_is_disjoint_and_stable():
    train, held = T.stdlib_files(20)
    names_t, names_h = [r for r, _ in train], [r for r, _ in held]
    assert names_t == sorted(names_t) and names_h == sorted(names_h)
    assert not set(names_t) & set(names_h)
    assert 0.01 < len(held) / (len(train) + len(held)) < 0.15
    assert not any(part in T.SKIP_DIRS for r in names_t + names_h for part in r.split("/")[:-1])
