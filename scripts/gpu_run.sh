#!/usr/bin/env bash
# The GPU machine's one command: GPU test tier, then the benchmarks, summary table last.
#
#   scripts/gpu_run.sh [all|tests|bench] [pytest arguments (default: tests)...]
#
# Logs, JUnit XML, benchmark JSON and PNG go to $OUT (default: bench_out/).  The machine has no
# package index: the cuDNN frontend wheel is brought in .whl/ (../shared/gpu/fetch-wheels.sh) and
# installed into /tmp/site; the project is installed editable (graphs/ and jax_bridge/ map to
# cudnn_attn.graphs / cudnn_attn.jax_bridge, so the checkout alone is not importable).
# The defaults fit one 600 s device call: GPU_RUN_TEST_SECONDS (default 300) for the tests,
# GPU_RUN_BENCH_SECONDS (default 240) for the three benchmarks together (bench_attention, bench_fp8,
# bench_decode, in that order; each may use what is left but the 60 s kept for each one after it).
# GPU_RUN_BENCH_ARGS goes to every benchmark (default --quick; set it empty for the full runs).
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"; shift || true
case "$what" in all|tests|bench) ;; *) echo "usage: $0 [all|tests|bench] [pytest args...]" >&2; exit 2 ;; esac
OUT="${OUT:-bench_out}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX shares the GPU with CuPy and torch in one process

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
python3 -c "import cudnn, cudnn_attn; print('cuDNN', cudnn.backend_version(), 'cudnn_attn', cudnn_attn.__version__)"

status=0
if [ "$what" != bench ]; then
  echo "== GPU tests (log: $OUT/gpu_tests.log)"
  timeout -s INT -k 20 "${GPU_RUN_TEST_SECONDS:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider \
    --junitxml="$OUT/gpu_tests.xml" -o junit_family=xunit1 "${@:-tests}" > "$OUT/gpu_tests.log" 2>&1 || status=1
  tail -n 40 "$OUT/gpu_tests.log"
fi
if [ "$what" != tests ]; then
  benches=(attention fp8 decode jax)
  bench_end=$((SECONDS + ${GPU_RUN_BENCH_SECONDS:-240}))
  for i in "${!benches[@]}"; do
    name=${benches[$i]}
    limit=$((bench_end - SECONDS - 60 * (${#benches[@]} - i - 1)))   # keep 60 s for each one still to come
    if [ "$limit" -le 0 ]; then echo "== bench_$name: no time left"; status=1; continue; fi
    echo "== bench_$name (log: $OUT/bench_$name.log, at most ${limit} s)"
    timeout "$limit" python3 "benchmarks/bench_$name.py" --out "$OUT" ${GPU_RUN_BENCH_ARGS---quick} \
      > "$OUT/bench_$name.log" 2>&1 || status=1
  done
fi

python3 - "$OUT" "$what" <<'PY'
import json, os, sys, xml.etree.ElementTree as ET
from collections import Counter, defaultdict
out, what = sys.argv[1], sys.argv[2]
print("\n==================== summary ====================")
xml = os.path.join(out, "gpu_tests.xml")
if what != "bench" and os.path.exists(xml):
    files = defaultdict(Counter)
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("file") or case.get("classname", "?").replace(".", "/") + ".py"
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        files[name][kind] += 1
    print(f"{'test file':48s} {'passed':>6s} {'failed':>6s} {'error':>6s} {'skipped':>7s}")
    for name, c in sorted(files.items()):
        print(f"{name:48s} {c['passed']:6d} {c['failure']:6d} {c['error']:6d} {c['skipped']:7d}")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in ET.parse(xml).getroot().iter("testcase")
              if any(c.tag in ("failure", "error") for c in case)]
    for name in failed[:25]:
        print("  FAILED", name)
elif what != "bench":
    print("no test report (see gpu_tests.log)")
# Each benchmark prints its table last, from a header of its own.
for name, header in (("attention", "shape "), ("fp8", "== FP8"), ("decode", "== decode"), ("jax", "== JAX")):
    log = os.path.join(out, f"bench_{name}.log")
    if what == "tests" or not os.path.exists(log):
        continue
    text = open(log).read()
    start = text.rfind(header)
    print(text[start:].rstrip() if start >= 0 else f"bench_{name}: no table (timed out or failed), log tail:\n"
          + "\n".join(text.rstrip().splitlines()[-3:]))
PY
exit $status
