"""An HF model folder: config.json, the tokenizer, sentence-transformers settings, and its tensors one at a time.

`CheckpointReader.get(name)` returns one numpy array backed by the safetensors mmap, so a model
loader can cast and `device_put` each tensor and drop it before reading the next: the host never
holds a second full copy of the model.
"""
from __future__ import annotations

import json
import os
from typing import Iterator, Optional

import numpy as np

from jax_engine.errors import InvalidRequest, NotFound


class CheckpointError(InvalidRequest):
    """A checkpoint folder that cannot be served (names the file or tensor)."""


def read_config(path: str) -> dict:
    """config.json of a model folder, with clear errors for the common failures."""
    if not os.path.isdir(path):
        raise NotFound(f"model path {path!r} is not a readable directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"model path {path!r} has no config.json")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {cfg_path}: {e}") from e


def st_max_seq_length(path: str) -> Optional[int]:
    """max_seq_length from a sentence-transformers folder's sentence_bert_config.json, if any."""
    fn = os.path.join(path, "sentence_bert_config.json")
    try:
        with open(fn) as f:
            value = json.load(f).get("max_seq_length")
    except (OSError, ValueError):
        return None
    return int(value) if value else None


def load_tokenizer(path: str):
    """The folder's HF tokenizer (local files only), with a clear error when it is missing."""
    from transformers import AutoTokenizer  # heavy: transformers

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types for a broken folder
        raise CheckpointError(f"cannot load a tokenizer from {path!r}: {str(e).splitlines()[0]}") from e


class CheckpointReader:
    """Lazy access to every tensor of the `*.safetensors` files in a folder (sharded or not)."""

    def __init__(self, path: str):
        from safetensors import safe_open  # heavy: safetensors (only when weights are read)

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"model path {path!r} has no *.safetensors files")
        self._handles = {}
        self._where: dict[str, str] = {}
        for fn in files:
            full = os.path.join(path, fn)
            try:
                h = safe_open(full, framework="numpy")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot open {full}: {e}") from e
            self._handles[fn] = h
            for k in h.keys():
                self._where[k] = fn

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def find(self, *candidates: str) -> Optional[str]:
        """The first candidate name present (checkpoints differ in prefixes)."""
        for c in candidates:
            if c in self._where:
                return c
        return None

    def get(self, name: str, shape: Optional[tuple] = None) -> np.ndarray:
        """One tensor; `shape` (if given) is checked so a wrong checkpoint fails clearly."""
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} missing from checkpoint {self.path!r}")
        arr = self._handles[self._where[name]].get_tensor(name)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}"
            )
        return arr

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for k in self._where:
            yield k, self.get(k)
