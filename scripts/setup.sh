#!/usr/bin/env bash
# Set up torch_kvcm2 in ./.venv: torch 2.13.0 (PyTorch's CPU-only build when no GPU is visible,
# its CUDA build when one is), the build tools, the test tools and the optional extras, then the
# extension itself, showing the build's progress. The CPU build takes about 4-5 minutes on 2
# cores; with a CUDA toolkit the CUDA kernels add several more (MAX_JOBS sets the parallel jobs).
#   EXTRAS=models,metrics,bench (default) picks the extras: models (transformers, for
#   examples/generate.py), metrics (prometheus_client), bench (matplotlib); EXTRAS= installs none.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
extras="${EXTRAS-models,metrics,bench}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] a GPU is visible: PyTorch's CUDA build of torch 2.13.0 (a few GB of wheels)"
  torch_index=()
else
  echo "[setup] no GPU: PyTorch's CPU-only build of torch 2.13.0 (about 200 MB)"
  torch_index=(--index-url https://download.pytorch.org/whl/cpu --retries 1)
fi
"${pip[@]}" "${torch_index[@]}" torch==2.13.0
"${pip[@]}" numpy ninja "setuptools>=77" pytest expecttest
echo "[setup] building the extension (about 4-5 min on 2 cores; ninja's [n/N] lines are progress)"
start=$(date +%s)
target="."
[ -n "$extras" ] && target=".[$extras]"
# --no-build-isolation: build against the torch installed above, not a fresh copy in an isolated
# environment (which would download torch again and rebuild from scratch)
set +e  # the filter below may match nothing; the build's own status decides
MAX_JOBS="${MAX_JOBS:-2}" .venv/bin/python -m pip install -v --no-build-isolation -e "$target" 2>&1 \
  | grep --line-buffered -E '^ *(\[[0-9]+/[0-9]+\]|\[torch_kvcm2\])|rror|^Successfully' \
  | sed -u -E 's#^ *(\[[0-9]+/[0-9]+\]) .* -c (/[^ ]*/)?([^ /]+\.(cpp|cu)) .*#\1 compiling \3#; s#^ +##'
status=${PIPESTATUS[0]}
set -e
[ "$status" = 0 ] || { echo "[setup] the build failed (rerun without the filter: .venv/bin/python -m pip install -v --no-build-isolation -e .)"; exit "$status"; }
took=$(( $(date +%s) - start ))
.venv/bin/python -c "import torch, torch_kvcm2 as kv; print(f'[setup] ready after {$took} s of build: torch {torch.__version__}, CUDA kernels: {kv.has_cuda_kernels()}')"
