#!/usr/bin/env bash
# The one script for the device machine (H200): build the extension, run the CUDA tests, run benchmarks,
# leave logs and JSON under $OUT. Run through the device tool from the repo root with carry [".whl"]
# (scripts/prepare_device.sh fills it here; the device has no network):
#   bash scripts/device_check.sh [-k PYTEST_EXPR] [-s SANITIZE_EXPR] ["BENCH_MODULE [ARGS]" ...]
# -s runs compute-sanitizer (memcheck, then racecheck) over the CUDA tests of tests/ops and tests/model
# selected by SANITIZE_EXPR (keep it to small shapes: memcheck slows kernels 10-100x), before the tests;
# logs in sanitize.log. SANITIZE_TIMEOUT (default 300) bounds each tool's run, in seconds.
#   e.g. -s "(test_embedding and not 27b) or small_vocab or bad_token_in_a_replayed_step" (the embedding
#   kernels and the speculative and plain step graphs on tests/model/test_speculative.py's small model)
# e.g. QWEN38_COMMIT=1a2b3c4 bash scripts/device_check.sh -k gemv benchmarks.ops.bench_q8_gemv \
#        "benchmarks.prefill --lengths 512,4096"
# (the device copy of the tree has no .git: QWEN38_COMMIT, the hash of the commit sent, names it in logs and results)
# At most 8 files come back from $OUT: build.log, sanitize.log, tests.log, bench.log, benchmarks.json.
set -uo pipefail
OUT=${OUT:-$PWD/.device_out}
mkdir -p "$OUT" "$OUT/bench"
expr="" sanitize=""
if [ "${1:-}" = "-k" ]; then expr=$2; shift 2; fi
if [ "${1:-}" = "-s" ]; then sanitize=$2; shift 2; fi

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1  # the oracle travels with the tree (tests/oracle)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/build.log"
echo "commit ${QWEN38_COMMIT:-unknown}" | tee -a "$OUT/build.log"
start=$(date +%s)
if ! python3 setup.py build_ext --inplace >>"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"

sanitize_rc=0
if [ -n "$sanitize" ]; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool, tests/ops tests/model -k '$sanitize'" | tee -a "$OUT/sanitize.log"
    timeout "${SANITIZE_TIMEOUT:-300}" "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 20 \
      python3 -m pytest -m cuda tests/ops tests/model -q -x -p no:cacheprovider -k "$sanitize" >>"$OUT/sanitize.log" 2>&1
    rc=$?
    echo "$tool: exit $rc" | tee -a "$OUT/sanitize.log"
    [ $rc -ne 0 ] && sanitize_rc=$rc
  done
  tail -5 "$OUT/sanitize.log"
fi

test_args=(-m cuda tests -q -rfs --durations=10)
[ -n "$expr" ] && test_args+=(-k "$expr")
python3 -m pytest "${test_args[@]}" 2>&1 | tee "$OUT/tests.log"
test_rc=${PIPESTATUS[0]}

for bench in "$@"; do
  read -r -a words <<<"$bench"  # a module, then its own arguments
  module=${words[0]}
  echo "== $bench" | tee -a "$OUT/bench.log"
  python3 -m "$module" "${words[@]:1}" --json "$OUT/bench/${module##*.}.json" 2>&1 | tee -a "$OUT/bench.log"
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = {p.stem: json.loads(p.read_text()) for p in sorted((out / "bench").glob("*.json"))}
if parts:
    (out / "benchmarks.json").write_text(json.dumps(parts, indent=1))
for p in (out / "bench").glob("*.json"):
    p.unlink()
(out / "bench").rmdir()
PY
[ $test_rc -eq 0 ] && test_rc=$sanitize_rc
exit $test_rc
