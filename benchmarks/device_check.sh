#!/usr/bin/env bash
# Device check for a lent NVIDIA GPU machine (an H200): parity on the GPU, a ~1B-parameter
# generate benchmark, a serve check; ONE JSON summary line at the end (also written to
# $OUT/device_check.json when $OUT is set). The logic is benchmarks/device_check.py.
#
#   bash benchmarks/device_check.sh prepare [--wheels]   # HERE (CPU, torch + transformers):
#        # .device_check/tiny-llama/ (tiny random HF Llama), .device_check/reference.npz (HF float32
#        # logits, greedy tokens and top-2 margins), the same for a dense newer family and a mixture
#        # of experts (tiny-gemma2/, tiny-qwen3_moe/, reference-<family>.npz; device_check.py's
#        # EXTRA_FAMILIES, together < 2 MiB); --wheels adds .device_check/wheels/ (cp312
#        # manylinux wheels of the deps the GPU image lacks, at the versions installed here, ~11 MiB)
#   bash benchmarks/device_check.sh [run options]        # ON THE GPU (< 8 minutes; budget 420 s of steps)
#        # options: --peak-tbps 4.8 --peak-tflops 989 --batches 1,16,64 --steps parity,bench,serve
#        #          --dtype auto --quantize none|int8|w8a8 --attention-backend auto|reference|pallas
#        #          --parity-backends auto,reference --budget-s 420
#        #          (all of them: python -m benchmarks.device_check run --help)
#   bash benchmarks/device_check.sh --dry-run            # the same code on CPU, tiny shapes (~1.5 minutes
#        # on 2 vCPUs, nearly all of it 6 tiny engines compiling, at LLVM level 0, which it sets),
#        # in ${TMPDIR:-/tmp}/xlaserve-device-check-dry-run unless --work DIR (tests/e2e/test_device_check.py)
#
# Every step runs the engine's ONE ragged step program per scheduler step (decode tokens and
# prefill chunks in one flat token list; jax_engine/decode/runner.py): parity decodes all prompts
# together and again staggered (the first prompt decoding while the others' chunks join its
# steps: greedy_staggered), against transformers; the bench records the step's token and page
# buckets. Expected time on an H200 (estimates, never measured): parity ~2 min (8 tiny engines,
# lazy compiles: the Llama at 2 dtypes x 2 backends, Gemma 2 and Qwen3-MoE at 2 dtypes), bench
# ~3 min (2.1 GiB model written, ~46 programs compiled: 19 token buckets x 2 (greedy, sampling),
# 6 prompt-logprobs, 2 small; 3 batch sizes x 3 runs), serve ~1 min (the
# server's warmup reads the programs from the compilation cache the bench filled).
# Each step starts only with enough of the budget left; a step that fails or is skipped is
# recorded and the others still run. If the driver dies, the last line is still one JSON object.
#
# Wrapper plan for the device tool (nothing else needs to be installed there):
#   1. here, once:   bash benchmarks/device_check.sh prepare --wheels
#      (.device_check/ is in .gitignore; together well under the 64 MiB a call may carry)
#   2. device tool:  run(command="bash benchmarks/device_check.sh", carry=[".device_check"], timeout_s=540)
#      This script installs .device_check/wheels/*.whl with pip --no-index --target (no network)
#      and puts them first on PYTHONPATH; it runs the image's python3 (JAX with CUDA; also torch
#      and transformers, so an unprepared parity reference is built there on the fly).
#      The random 1B model (~2.1 GiB bf16) is written on the device into .device_check/bench-1b/
#      and is never carried. Only $OUT/device_check.json comes back; the last stdout line is the
#      same JSON. Give the machine back right after unless a rerun follows at once.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if [ "${1:-}" = "prepare" ]; then
    shift
    exec "$PY" -m benchmarks.device_check prepare "$@"
fi

DRY=0
WORK=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --dry-run) DRY=1 ;;
        --work) WORK="${args[$((i + 1))]:-}" ;;
        --work=*) WORK="${args[$i]#--work=}" ;;
    esac
done
if [ -z "$WORK" ]; then
    # the dry run's files stay out of .device_check/, which is what travels to the GPU machine
    if [ "$DRY" = 1 ]; then WORK="${TMPDIR:-/tmp}/xlaserve-device-check-dry-run"; else WORK=".device_check"; fi
    args+=(--work "$WORK")
fi
mkdir -p "$WORK"

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false XLASERVE_PROGRESS=0
# the bench engine, then the server process, each allocate on demand (JAX would take 75% up front)
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$DRY" = 1 ]; then
    # XLA's dot on CPU: no kernel build, no matmul timing per tiny model (the device path has neither)
    export JAX_PLATFORMS=cpu XLASERVE_CPU_MATMUL=xla
    # a check of code paths, not of speed: its length is the host's compile time (216 s alone on a
    # 2-vCPU Zen 3 at XLA's default flags, 91 s at LLVM level 0), so LLVM runs at level 0 (the
    # caller's own level flag, e.g. the test suite's 1, is replaced) and the limit leaves room for a
    # busy host
    flags="--xla_backend_optimization_level=0"
    for f in ${XLA_FLAGS:-}; do
        case "$f" in --xla_backend_optimization_level*) ;; *) flags="$flags $f" ;; esac
    done
    export XLA_FLAGS="$flags"
    LIMIT=600
else
    LIMIT=470
    if [ -d "$WORK/wheels" ] && ls "$WORK"/wheels/*.whl >/dev/null 2>&1; then
        SITE=/tmp/xlaserve-device-site
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WORK"/wheels/*.whl >&2; then
            export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        else
            echo "device_check: installing the carried wheels failed; going on with the image's packages" >&2
        fi
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
fi

rm -f "$WORK/summary.json" "$WORK/partial.json"
timeout -k 10 "$LIMIT" "$PY" -m benchmarks.device_check run "${args[@]}"
rc=$?
if [ ! -s "$WORK/summary.json" ]; then
    # the driver died (crash, timeout): still end with one JSON line, holding what it finished
    partial="null"
    [ -s "$WORK/partial.json" ] && partial="$(cat "$WORK/partial.json")"
    line="{\"device_check\":1,\"ok\":false,\"error\":\"driver exited with status $rc before its summary (124 = timed out after ${LIMIT}s)\",\"partial\":$partial}"
    if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && printf '%s\n' "$line" >"$OUT/device_check.json"; fi
    printf '%s\n' "$line"
fi
exit $rc
