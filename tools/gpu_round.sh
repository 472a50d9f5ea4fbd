#!/usr/bin/env bash
# Several GPU checks in one invocation (docs/audit.md, "Batched GPU runs").
# Usage: tools/gpu_round.sh STAGE...   stages: verify tests sanitize probe_<name> tune bench ab
# Knobs: SEED, VERIFY_FILTER, VERIFY_WORKERS (default 8), SANITIZE_FILTER, SANITIZE_TOOL (memcheck, racecheck, synccheck), SANITIZE_JOBS, SANITIZE_LIMIT (per shard), SANITIZE_ARGS (e.g. --per-template), TESTS (files), TESTS_K (pytest -k; unset: "not bit_exact", empty: every test), TESTS_LIMIT, TUNE_ARGS, TUNE_LIMIT, BENCH_ARGS, BENCH_LIMIT, AB_TREE / AB_FILTER / AB_SHAPES (stage ab),
# ARGS_<probe stage> (extra arguments of that probe, e.g. ARGS_probe_dynamic='--cases 2').
# Everything lands flat in the output folder OUT (logs, probe JSON, audit records as audit.tar).
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1   # the caller's path after the tree (packages installed aside)
# A copy of the tree may carry a .git that is not its own (its HEAD is not the commit under test):
# the records must name the commit from the caller, so it is required.
: "${SKUFORGE_COMMIT:?set SKUFORGE_COMMIT to the commit under test (git rev-parse --short HEAD, here)}"
export SKUFORGE_COMMIT
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/smi.txt" 2>&1
t0=$(date +%s)
for stage in "$@"; do
  echo "== $stage ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/round.log"
  case $stage in
    verify) timeout -s INT 300 python3 -m codegen verify --seed ${SEED:-1} --filter "${VERIFY_FILTER:-*}" --workers ${VERIFY_WORKERS:-8} > "$OUT/verify.txt" 2>&1; rc=$?; tail -40 "$OUT/verify.txt" >> "$OUT/round.log" ;;
    tests)  timeout -s INT ${TESTS_LIMIT:-240} python3 -m pytest -q -x -p no:cacheprovider -m gpu ${TESTS:-tests/quantization/test_gpu_lowbit.py tests/quantization/test_gpu_static.py} -k "${TESTS_K-not bit_exact}" > "$OUT/tests.txt" 2>&1; rc=$?; tail -30 "$OUT/tests.txt" >> "$OUT/round.log" ;;
    probe_*) eval "extra=\${ARGS_$stage:-}"; timeout -s INT 240 python3 tools/$stage.py --out "$OUT/$stage.json" $extra > "$OUT/$stage.txt" 2>&1; rc=$?; tail -45 "$OUT/$stage.txt" >> "$OUT/round.log" ;;
    sanitize) python3 tools/sanitize.py --tool ${SANITIZE_TOOL:-memcheck} --filter "${SANITIZE_FILTER:-*}" --seed ${SEED:-1} --jobs ${SANITIZE_JOBS:-4} --limit ${SANITIZE_LIMIT:-540} ${SANITIZE_ARGS:-} --out "$OUT/sanitize" > "$OUT/sanitize.txt" 2>&1; rc=$?; tail -25 "$OUT/sanitize.txt" >> "$OUT/round.log" ;;
    tune)   # the arch's tuning table into OUT (the tree's table untouched; copy it beside the matrix to keep it)
            timeout -s INT ${TUNE_LIMIT:-300} python3 -m codegen tune --out "$OUT/tuning.json" ${TUNE_ARGS:-} > "$OUT/tune.txt" 2>&1; rc=$?; tail -20 "$OUT/tune.txt" >> "$OUT/round.log" ;;
    bench)  timeout -s INT ${BENCH_LIMIT:-420} python3 -m codegen bench ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1; rc=$?; tail -40 "$OUT/bench.txt" >> "$OUT/round.log" ;;
    ab)     # kernel time of this tree against another one (AB_TREE: a checkout beside this one, e.g. an
            # older commit's `git archive` in a folder .git/info/exclude ignores), in one run, alternating
            rc=0; for side in this other this other; do
              dir=.; [ $side = other ] && dir=${AB_TREE:?set AB_TREE to the other tree}
              ( cd "$dir" && PYTHONPATH=. timeout 120 python3 -m codegen bench --filter "${AB_FILTER:-quantization/*quantize/*/symmetric/*bf16*}" --no-torch --no-host --shapes ${AB_SHAPES:-8192x8192,65536x4096} --samples 40 --records /tmp/ab-$side ) >> "$OUT/ab-$side.txt" 2>&1 || rc=$?
            done
            for side in this other; do grep -E "GB/s|% copy" "$OUT/ab-$side.txt" | sed "s/^/[$side] /" >> "$OUT/round.log"; done ;;
    *) echo "unknown stage $stage (verify tests sanitize probe_* tune bench ab)" >> "$OUT/round.log"; rc=64 ;;
  esac
  # a stage cut by its time limit must say so (timeout's SIGINT: pytest exits 2 with no summary)
  if [ $rc -ne 0 ]; then echo "!! $stage exited $rc$( [ $rc -eq 124 ] || [ $rc -eq 130 ] || [ $rc -eq 2 ] && echo ' (time limit or interrupt: incomplete)')" | tee -a "$OUT/round.log"; fi
  tar cf "$OUT/audit.tar" audit/verified audit/bench 2>/dev/null   # after every stage: a cut-off run keeps its records
done
echo "== done ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/round.log"
tail -c 11000 "$OUT/round.log"
