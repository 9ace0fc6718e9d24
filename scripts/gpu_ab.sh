#!/usr/bin/env bash
# A/B of benchmark ids between an older commit and the working tree, on the device machine:
#   git archive <commit> | tar -x -C .ab      # here, before the call (.ab is in .git/info/exclude)
#   BASE=.ab IDS=P-HOST,P-STEP-WALL,P-STEP-1 ROUNDS=2 bash scripts/gpu_ab.sh   # there, carry .ab
# Builds BASE in place (the working tree is built by scripts/gpu_check.sh, or here when it has no
# library yet), then runs benchmarks/run.py --only IDS alternately on the base and on the working
# tree, ROUNDS times each, so drift of the machine falls on both sides alike. Logs: $OUT/ab_*.txt.
set -uo pipefail
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
BASE="${BASE:-.ab}"; IDS="${IDS:-P-HOST,P-STEP-WALL,P-STEP-1}"; ROUNDS="${ROUNDS:-2}"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" TORCH_KVCM2_CUDA=1
export MAX_JOBS="${MAX_JOBS:-16}"
[ -x /usr/bin/g++ ] && export CC=/usr/bin/gcc CXX=/usr/bin/g++
[ -d "$BASE" ] || { echo "no base tree at $BASE"; exit 2; }
inplace() {  # inplace DIR NAME: build DIR's extension next to its sources
  local start=$(date +%s)
  (cd "$1" && python3 setup.py -q build_ext --inplace) > "$OUT/ab_build_$2.log" 2>&1 \
    || { tail -40 "$OUT/ab_build_$2.log"; exit 1; }
  echo "built $2 in $(( $(date +%s) - start )) s" | tee -a "$OUT/ab_summary.txt"
}
inplace "$BASE" base
ls torch_kvcm2/_C*.so >/dev/null 2>&1 || inplace . head
for side in base head; do  # each side must import its own tree
  dir=$([ "$side" = base ] && echo "$BASE" || echo .)
  (cd "$dir" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    "import torch_kvcm2 as k; print('$side imports', k.__file__, 'cuda kernels', k.has_cuda_kernels())") \
    | tee -a "$OUT/ab_summary.txt"
done
for round in $(seq 1 "$ROUNDS"); do
  for side in base head; do
    dir=$([ "$side" = base ] && echo "$BASE" || echo .)
    (cd "$dir" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/run.py --only "$IDS") \
      > "$OUT/ab_${side}_$round.txt" 2>&1
    echo "== $side round $round (rc $?)" | tee -a "$OUT/ab_summary.txt"
    grep -E "^(\| P-|# P-)" "$OUT/ab_${side}_$round.txt" | head -40 | tee -a "$OUT/ab_summary.txt"
  done
done
