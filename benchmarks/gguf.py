"""GGUF files for the llama.cpp peer, written by llama.cpp's own converter from the benchmark's HF folder.

Where the converter comes from: llama-cpp-python's sdist carries llama.cpp's source under
vendor/llama.cpp/: convert_hf_to_gguf.py, its `conversion` package and the matching gguf-py.
The first conversion downloads that sdist once with pip

    python -m pip download --no-binary :all: --no-deps llama-cpp-python==<installed version>

(the version of the llama.cpp that will read the file; the `bench` extra pins 0.3.36) and keeps
only those parts and llama.cpp's LICENSE under <bench cache>/llama.cpp-<version>/. Nothing of
llama.cpp is in this repository. `XLASERVE_LLAMA_CPP_SDIST=/path/llama_cpp_python-<v>.tar.gz`
uses a local sdist instead (offline hosts).

One thing is changed in how the converter behaves, from outside (no file of it is edited): the
benchmark model's tokenizer is a byte-level BPE (pre-tokenizer ByteLevel with use_regex, i.e.
GPT-2's regex), and llama.cpp recognises a BPE pre-tokenizer by hashing the ids of a probe string
against a list of published models; ours is on no list, so the converter would stop with "BPE
pre-tokenizer was not recognized". For that case only, the wrapper answers "gpt-2", the
llama.cpp pre-tokenizer that is GPT-2's ByteLevel regex. It only labels the vocabulary: the
benchmark feeds token ids and never tokenizes text in llama.cpp. The weights are converted by
the converter as it is (`--outtype f32 | f16 | bf16 | q8_0`: 2-D weights in that type, norms in F32).

The converter imports torch, transformers, numpy, sentencepiece (imported before it looks for a
tokenizer.model, so it is needed for a BPE model too), and gguf-py needs pyyaml and tqdm; it runs
in a subprocess (the engine's process has torch blocked).

Which GGUF type stands against which engine dtype (`llama_type`):
  float32  -> F32
  bfloat16 -> BF16 where the CPU has avx512_bf16 (ggml then runs BF16 dot products natively; the
              same number format as the engine's), else F16 (what llama.cpp users run on such a
              host; both are 2 bytes per weight)
  int8, w8a8 -> Q8_0 (8-bit blocks of 32 with an F16 scale: 8.5 bits per weight; the engine's int8
              weights are per output channel, w8a8's activations per row; the embedding and norms
              unquantized in both)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C

PINNED_VERSION = "0.3.36"          # the bench extra's llama-cpp-python
OUTTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}
# what the converter needs from the sdist (relative to vendor/llama.cpp/)
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "LICENSE")


def llama_type(dtype: str, flags: set[str] | None = None, half: str = "auto") -> str:
    """The GGUF type compared with an engine dtype (see the module docstring).

    `half` forces the 2-byte type ('BF16' or 'F16'); 'auto' picks BF16 where the CPU has avx512_bf16."""
    if dtype == "float32":
        return "F32"
    if dtype in ("int8", "bfloat16+int8", "w8a8"):
        return "Q8_0"
    if dtype == "bfloat16":
        if half.upper() in ("BF16", "F16"):
            return half.upper()
        return "BF16" if "avx512_bf16" in (C.cpu_flags() if flags is None else flags) else "F16"
    raise ValueError(f"no GGUF type for engine dtype {dtype!r}")


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (the converter must match its reader), else the pin."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return PINNED_VERSION


def converter_dir(cache: str | None = None, version: str | None = None) -> str:
    """<cache>/llama.cpp-<version>/ holding convert_hf_to_gguf.py, conversion/ and gguf-py/gguf/;
    fetched from the llama-cpp-python sdist the first time."""
    version = version or llama_cpp_version()
    dest = os.path.join(cache or C.bench_cache_root(), f"llama.cpp-{version}")
    if os.path.isfile(os.path.join(dest, "convert_hf_to_gguf.py")):
        return dest
    sdist = os.environ.get("XLASERVE_LLAMA_CPP_SDIST")
    with tempfile.TemporaryDirectory() as tmp:
        if not sdist:
            C.log(f"downloading the llama-cpp-python {version} sdist once, for llama.cpp's convert_hf_to_gguf.py ...")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={version}", "-d", tmp, "--quiet"], check=True)
            sdist = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".tar.gz"))
        extract_converter(sdist, dest)
    return dest


def extract_converter(sdist: str, dest: str) -> None:
    """Copy the converter's parts out of the sdist into `dest` (atomically: a temp dir, renamed)."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".llama.cpp-")
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/", 1)
                rel = parts[1] if len(parts) > 1 else ""
                if not rel.startswith("vendor/llama.cpp/"):
                    continue
                rel = rel[len("vendor/llama.cpp/"):]
                if any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in _KEEP) and (m.isfile() or m.isdir()):
                    m.name = rel
                    members.append(m)
            if not any(m.name == "convert_hf_to_gguf.py" for m in members):
                raise RuntimeError(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py in it")
            tar.extractall(tmp, members=members, filter="data")
        with open(os.path.join(tmp, "SOURCE.json"), "w") as f:
            json.dump({"sdist": os.path.basename(sdist), "kept": list(_KEEP),
                       "note": "llama.cpp's converter, from the llama-cpp-python sdist (MIT, see LICENSE)"}, f)
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def gguf_path(hf_path: str, gguf_type: str, cache: str | None = None) -> str:
    name = os.path.basename(os.path.normpath(hf_path))
    return os.path.join(cache or C.bench_cache_root(), "gguf", f"{name}-{gguf_type}.gguf")


def ensure_gguf(hf_path: str, gguf_type: str, cache: str | None = None) -> str:
    """The GGUF of `hf_path` in `gguf_type` (F32, F16, BF16, Q8_0), converted once (again when the
    HF weights are newer than the file)."""
    out = gguf_path(hf_path, gguf_type, cache)
    weights = os.path.join(hf_path, "model.safetensors")
    if os.path.isfile(out) and (not os.path.isfile(weights) or os.path.getmtime(out) >= os.path.getmtime(weights)):
        return out
    conv = converter_dir(cache)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".part"
    C.log(f"converting {hf_path} to GGUF {gguf_type} with llama.cpp's convert_hf_to_gguf.py ...")
    t0 = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "benchmarks.gguf", conv, hf_path, "--outtype", OUTTYPES[gguf_type],
                        "--outfile", tmp], cwd=C.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, check=False)
    if p.returncode != 0 or not os.path.isfile(tmp):
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({p.returncode}):\n{p.stdout[-3000:]}")
    os.replace(tmp, out)
    C.log(f"  {os.path.getsize(out) / 2 ** 20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
    return out


def run_converter(conv: str, args: list[str]) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py from `conv` with `args` in this process (see the module
    docstring for the one pre-tokenizer fallback)."""
    import runpy

    sys.path[:0] = [conv, os.path.join(conv, "gguf-py")]
    import conversion.base as base  # llama.cpp's, from `conv`

    recognise = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            # ByteLevel(use_regex=True) is GPT-2's pre-tokenizer; only unrecognised ones get here
            pre = (getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None))
            if pre is not None and "ByteLevel" not in type(pre).__name__ + repr(pre):
                raise
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = os.path.join(conv, "convert_hf_to_gguf.py")
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run_converter(sys.argv[1], sys.argv[2:])
