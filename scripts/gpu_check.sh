#!/usr/bin/env bash
# The GPU round trip, run on the device machine from the repo root:
#   build the production CUDA extension against the machine's torch, run the CUDA tests, a long
#   data-safety run and the benchmarks; then, for the runs that need the development switch
#   (docs/DEVELOPMENT.md), rebuild with TORCH_KVCM2_DEV and run those. Logs go to $OUT (the device
#   tool brings them back). Every call starts with the production build again.
# Usage: [TESTS=0] [TEST_RUNS=N] [STALE=0] [EXAMPLES=0] [LONG=0] [BENCH=0] [BENCH_ONLY=IDS] [SCALING=1] [SWEEP=1]
#        [ATTN=1] [INDEXER=1] [SERVE=1] [SERVE_ARGS=...]
#        [PDL_AB=1] [PROFILE=1] [NCU=1] [AB_THREADS=N] [KVCM2_SAFETY_STEPS=N]
#        bash scripts/gpu_check.sh [pytest args]
# Production build:
#   TESTS=0 skips the CUDA tests and the examples (a benchmark-only call on unchanged code);
#   TEST_RUNS=N runs the CUDA suite N times in a row (tests_cuda_1.log ...; default 1);
#   SHARDS=N runs each suite run as N pytest processes side by side, the test files dealt out
#   round robin (tests_cuda_1_shard1.log ...): about N times faster on the GPU machine's cores,
#   and a second process on the GPU shows host reads that do not wait for the device;
#   SUITE=0 skips the CUDA suite but not the examples (a second call on a warm machine);
#   EXAMPLES=0 skips only the examples (sparse_decode.py eager, --compile, --compile
#   reduce-overhead, --graph; shared_prefix.py; serve.py eager and --graph --delays; generate.py
#   --check: both models, bf16, the absorbed kernel, --compile and --graph of both).
#   SERVE=1 runs benchmarks/serve.py (P-SERVE: serve.txt, serve.json, serve.png);
#   SERVE_ARGS="--gpu-history-gb 10" gives torch_kvcm2's side GPU-resident history (RSD-1).
#   BENCH_ONLY=P-DEMOTE runs the demotion benchmark (RSD-2) alone.
#   ATTN=1 runs benchmarks/bench_attn.py (P-ATTN: attn.txt, attn.json; ATTN_ARGS its flags).
#   INDEXER=1 runs benchmarks/bench_indexer.py --sweep $INDEXER_SWEEP (both, logits or topk):
#   P-SERVE's DSA indexer logits and top-k alone, every launch config (indexer.txt, indexer.json).
#   BENCH_ONLY=P-RES,P-STEP runs only those benchmark ids (run.py --only); without it the
#   benchmarks end with benchmarks/eager_parts.py (the eager step's host time per call).
#   NCU=1 profiles one steady-state launch of P-RES's resolve kernel with Nsight Compute (full
#   set, clocks left alone): ncu_resolve.txt (details) and ncu_resolve_source.csv (per-SASS
#   instruction stall samples). NCU_CACHE=none keeps the caches warm between the profiler's
#   passes (its default flushes them, instruction cache included, before each pass).
# Development build (TORCH_KVCM2_DEV=1, rebuilt after the production runs, only when one of these
# runs is asked for):
#   with TESTS=1 (default) and STALE=1 (default), the residency tests again with
#   KVCM2_RESOLVE_FORCE_STALE=1 (the resolve kernel alters the lease, history and capacity it
#   reads before the PDL wait, so every row redoes its first attempt with the values read after
#   the wait); STALE=0 skips them and, with no other development run, the rebuild.
#   SWEEP=1 adds benchmarks/fetch_sweep.py (the fetch kernel's tuning knobs; SWEEP_ARGS are its
#   arguments).
#   PDL_AB=1 adds P-RES, P-INDEX and P-STEP with KVCM2_PDL=0 (launches without PDL), then with
#   PDL again, for an A/B (both on the development build).
#   AB_THREADS=1024 rebuilds the resolve kernel with that many threads per CTA
#   (TORCH_KVCM2_RESOLVE_THREADS), runs the residency tests and P-RES on it, then P-RES on the
#   development build of the default size (bench_threads*.txt).
#   PROFILE=1 finally rebuilds with the resolve kernel's phase timer (TORCH_KVCM2_DEV=profile)
#   and prints the phase cycles of CTA 0 over P-RES's launches (the load and hash phases also in
#   parts), without PDL and with it.
#   PACK=0 leaves the logs as they are; by default, when the script ends (also when a timeout
#   stops it with SIGTERM), every file under $OUT but gpu.txt goes into $OUT/logs.tgz: the device
#   tool brings back at most 8 files, and a run writes a dozen.
set -uo pipefail
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
pack() {
  [ "${PACK:-1}" = 1 ] || return 0
  (cd "$OUT" && tar czf /tmp/gpu_logs.tgz --exclude=./logs.tgz --exclude=./gpu.txt . 2>/dev/null \
    && mv /tmp/gpu_logs.tgz logs.tgz \
    && find . -mindepth 1 -maxdepth 1 ! -name logs.tgz ! -name gpu.txt -exec rm -rf {} +)
}
trap pack EXIT
trap 'exit 143' TERM
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" TORCH_KVCM2_CUDA=1
export MAX_JOBS="${MAX_JOBS:-16}"
# The image's default g++ (/opt/gcc/bin/g++) is a wrapper that links its own libstdc++ into the
# extension, which then crashes on formatted TORCH_CHECK messages: build with the system compiler.
[ -x /usr/bin/g++ ] && export CC=/usr/bin/gcc CXX=/usr/bin/g++
# expecttest is missing there: install the carried wheel when present
if ls .whl/expecttest-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
# build NAME [VAR=VALUE ...]: pip install -e . with those variables set; the log is $OUT/build_NAME.log
build() {
  local name=$1; shift
  local start=$(date +%s)
  env -u TORCH_KVCM2_DEV -u TORCH_KVCM2_RESOLVE_THREADS "$@" \
    python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/build_$name.log" 2>&1
  local rc=$?
  echo "build $name rc=$rc in $(( $(date +%s) - start )) s: $(grep -m1 '^\[torch_kvcm2\]' "$OUT/build_$name.log")" \
    | tee -a "$OUT/gpu.txt"
  [ $rc -eq 0 ] || tail -60 "$OUT/build_$name.log"
  return $rc
}
# The development knobs' names are in the library only when the development switch built them.
knobs_in_library() { grep -c -a -E 'KVCM2_(PDL|FETCH_ILP|RESOLVE_FORCE_STALE)' torch_kvcm2/_C*.so; }
build production || exit 1
python3 -c "import torch_kvcm2 as k; assert k.has_cuda_kernels(), 'no CUDA kernels'; print('CUDA kernels OK')"
[ "$(knobs_in_library)" = 0 ] && echo "production build: no development knob" | tee -a "$OUT/gpu.txt" \
  || { echo "production build names development knobs"; exit 1; }
if [ "${TESTS:-1}" = 1 ]; then
  [ "${SUITE:-1}" = 1 ] && for run in $(seq 1 "${TEST_RUNS:-1}"); do
    if [ "${SHARDS:-1}" -gt 1 ]; then
      files=(tests/test_*.py)
      for k in $(seq 1 "$SHARDS"); do
        shard=()
        for i in "${!files[@]}"; do [ $(( i % SHARDS + 1 )) = "$k" ] && shard+=("${files[$i]}"); done
        python3 -m pytest -q -p no:cacheprovider -m cuda "${shard[@]}" "$@" \
          > "$OUT/tests_cuda_${run}_shard$k.log" 2>&1 &
      done
      wait
      for k in $(seq 1 "$SHARDS"); do
        grep -E "^(FAILED|ERROR)" "$OUT/tests_cuda_${run}_shard$k.log" | head -20
        echo "cuda tests, run $run, shard $k: $(tail -1 "$OUT/tests_cuda_${run}_shard$k.log")" | tee -a "$OUT/gpu.txt"
      done
      continue
    fi
    python3 -m pytest -q -p no:cacheprovider -m cuda tests "$@" 2>&1 | tee "$OUT/tests_cuda_$run.log" | tail -25
    echo "cuda tests, run $run: ${PIPESTATUS[0]} ($(tail -1 "$OUT/tests_cuda_$run.log"))" | tee -a "$OUT/gpu.txt"
  done
  # the main example on the GPU: eager, compiled, and compiled into CUDA graphs
  [ "${EXAMPLES:-1}" = 1 ] && for run in "sparse_decode.py" "sparse_decode.py --compile" \
      "sparse_decode.py --compile reduce-overhead" "sparse_decode.py --graph" \
      "shared_prefix.py" "serve.py" "serve.py --graph --delays" \
      "generate.py --check" "generate.py --check --arch glm" "generate.py --check --dtype bfloat16" \
      "generate.py --check --mode absorbed --kernel sparse_mla" \
      "generate.py --check --compile" "generate.py --check --graph" \
      "generate.py --check --arch glm --compile" "generate.py --check --arch glm --graph"; do
    echo "== examples/$run" | tee -a "$OUT/examples.log"
    python3 examples/$run 2>&1 | tail -7 | tee -a "$OUT/examples.log"
    echo "example $run rc: ${PIPESTATUS[0]}" | tee -a "$OUT/examples.log" "$OUT/gpu.txt"
  done
fi
[ "${LONG:-1}" = 1 ] && KVCM2_SAFETY_STEPS="${KVCM2_SAFETY_STEPS:-3000}" python3 -m pytest -q -p no:cacheprovider -m cuda \
  tests/test_data_safety.py 2>&1 | tee "$OUT/tests_safety_long.log" | tail -3
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/run.py --json "$OUT/bench.json" ${SCALING:+--scaling} \
    ${BENCH_ONLY:+--only "$BENCH_ONLY"} 2>&1 | tee "$OUT/bench.txt"
  [ -z "${BENCH_ONLY:-}" ] && python3 benchmarks/eager_parts.py 2>&1 | tee "$OUT/eager_parts.txt"
fi
if [ "${ATTN:-0}" = 1 ]; then
  # P-ATTN: the sparse MLA decode kernel over cells against the same kernel over a dense cache
  python3 benchmarks/bench_attn.py --json "$OUT/attn.json" ${ATTN_ARGS:-} 2>&1 | tee "$OUT/attn.txt"
  echo "attn rc: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu.txt"
fi
if [ "${INDEXER:-0}" = 1 ]; then
  python3 benchmarks/bench_indexer.py --sweep ${INDEXER_SWEEP:-both} --json "$OUT/indexer.json" 2>&1 | tee "$OUT/indexer.txt"
  echo "indexer rc: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu.txt"
fi
if [ "${SERVE:-0}" = 1 ]; then
  # P-SERVE: both sides, both contexts, table + JSON + plot (matplotlib when installed)
  python3 benchmarks/serve.py --json "$OUT/serve.json" --plot "$OUT/serve.png" ${SERVE_ARGS:-} \
    2>&1 | tee "$OUT/serve.txt" | grep -v "^\[" ; echo "serve rc: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu.txt"
fi
if [ "${NCU:-0}" = 1 ]; then
  # launch 1 is P-RES's cold first resolve (every unit a miss); launch 2 is the timer's warm-up
  # call of the steady state (1% misses)
  ncu --clock-control none ${NCU_CACHE:+--cache-control "$NCU_CACHE"} --set full --import-source yes \
    -k regex:resolve_kernel -s 1 -c 1 \
    -o "$OUT/ncu_resolve" -f python3 benchmarks/run.py --only P-RES > "$OUT/ncu_run.log" 2>&1
  echo "ncu rc: $?" | tee -a "$OUT/gpu.txt"
  ncu -i "$OUT/ncu_resolve.ncu-rep" --page details --print-details all > "$OUT/ncu_resolve.txt" 2>&1
  ncu -i "$OUT/ncu_resolve.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_resolve_source.csv" 2>&1
  grep -E "Duration|Elapsed Cycles|Stall|Warp Cycles|Issued|Bank|Occupancy" "$OUT/ncu_resolve.txt" | head -40
fi
# ---- development build: the runs below read the development knobs
stale=$([ "${TESTS:-1}" = 1 ] && [ "${STALE:-1}" = 1 ] && echo 1 || echo 0)
if [ "$stale" = 1 ] || [ "${SWEEP:-0}" = 1 ] || [ "${PDL_AB:-0}" = 1 ] || [ -n "${AB_THREADS:-}" ]; then
  build dev TORCH_KVCM2_DEV=1 || exit 1
  [ "$(knobs_in_library)" != 0 ] || { echo "development build without its knobs"; exit 1; }
fi
if [ "$stale" = 1 ]; then
  KVCM2_RESOLVE_FORCE_STALE=1 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_residency_ops.py \
    2>&1 | tee "$OUT/tests_cuda_stale.log" | tail -3
  echo "cuda residency tests, every early read stale: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu.txt"
fi
if [ "${SWEEP:-0}" = 1 ]; then
  python3 benchmarks/fetch_sweep.py --json "$OUT/fetch_sweep.json" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/fetch_sweep.txt"
fi
if [ "${PDL_AB:-0}" = 1 ]; then
  # without PDL, then with it again in a fresh process (processes differ by about +-0.4 us)
  KVCM2_PDL=0 python3 benchmarks/run.py --only P-RES,P-INDEX,P-STEP 2>&1 | tee "$OUT/bench_nopdl.txt"
  python3 benchmarks/run.py --only P-RES,P-INDEX,P-STEP 2>&1 | tee "$OUT/bench_pdl2.txt"
fi
if [ -n "${AB_THREADS:-}" ]; then
  python3 benchmarks/run.py --only P-RES 2>&1 | tee "$OUT/bench_threads_default.txt"
  build threads TORCH_KVCM2_DEV=1 TORCH_KVCM2_RESOLVE_THREADS="$AB_THREADS" &&
  python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_residency_ops.py 2>&1 | tail -2 | tee "$OUT/tests_threads.log" &&
  python3 benchmarks/run.py --only P-RES 2>&1 | tee "$OUT/bench_threads_$AB_THREADS.txt"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  # Without PDL (the critical path of one launch) and with it (as P-RES runs: "wait" is the time
  # a CTA that started early spends waiting for the previous launch).
  build profile TORCH_KVCM2_DEV=profile || exit 1
  for pdl in 0 1; do
    KVCM2_PDL=$pdl python3 benchmarks/run.py --only P-RES 2>&1 | grep "^resolve " > "$OUT/profile_raw_pdl$pdl.txt"
    python3 - "$OUT/profile_raw_pdl$pdl.txt" "$pdl" <<'PY' | tee -a "$OUT/profile.txt"
import statistics, sys
lines = [l for l in open(sys.argv[1]) if ":" in l]
rows = [[int(x) for x in l.split(":")[1].split()] for l in lines if l.startswith("resolve phases")]
parts = [[int(x) for x in l.split(":")[1].split()] for l in lines if l.startswith("resolve parts")]
names = "fill wait lease load hash slots columns victims place index scan2 write".split()
print(f"resolve phases, CTA 0, KVCM2_PDL={sys.argv[2]}, median cycles over {len(rows)} launches")
for i, n in enumerate(names):
    print(f"  {n:8s} {statistics.median(r[i] for r in rows):8.0f}")
print(f"  total    {statistics.median(sum(r) for r in rows):8.0f}")
print(f"  after wait {statistics.median(sum(r[2:]) for r in rows):6.0f}")
part_names = ("load: issue+rules", "load: infl fill", "load: selection wait", "load: direct insert",
              "load: verify+vote", "hash: insert", "hash: recency staging", "hash: resident wait",
              "write: miss-list entries", "write: recency row")
for i, n in enumerate(part_names if parts else ()):
    print(f"  {n:22s} {statistics.median(r[i] for r in parts):6.0f}")
ctas = sorted(int(l.split(":")[1]) for l in lines if l.startswith("resolve cta"))
if ctas:  # thread 0 of every CTA, every launch
    q = lambda f: ctas[min(len(ctas) - 1, int(f * len(ctas)))]
    print(f"  every CTA after the wait ({len(ctas)}): median {q(0.5)}, p90 {q(0.9)}, "
          f"p98.5 {q(0.985)} (~ a launch's slowest of 64), max {ctas[-1]}")
PY
  done
fi
