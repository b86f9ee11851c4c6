#!/usr/bin/env bash
# The GPU machine's one command: install, then scripts/gpu_run.py (GPU tests, benchmarks; summary last).
#
#   scripts/gpu_run.sh [PHASE ...] [--budget SECONDS] [--full] [--bundle]   (phases: see scripts/gpu_run.py)
#
# Logs, JUnit XML and benchmark JSON/PNG go to $OUT (default: bench_out/).  The machine has no package
# index: the cuDNN frontend wheel is brought in .whl/ (../shared/gpu/fetch-wheels.sh) and installed into
# /tmp/site; the project is installed editable (graphs/ and jax_bridge/ map to cudnn_attn.graphs /
# cudnn_attn.jax_bridge, so the checkout alone is not importable).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-bench_out}"
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then     # the device machine keeps /tmp between loans
  echo "warning: $OUT is not empty; files of an earlier run lie beside this run's (start from an empty folder)" >&2
fi
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX shares the GPU with CuPy and torch in one process
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1              # a native crash in any phase prints every thread's Python stack
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
# A user's `pip install` writes bytecode; the wheel above is installed with --no-compile (the machine's
# README) and PYTHONDONTWRITEBYTECODE may be set, which would make every new process compile the frontend's
# and our modules again (tens of ms of each first call).  Compile once, as an install does.
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}" >> "$OUT/install.log"
# The same for the machine's own packages that `import cudnn_attn` and a first call import: where they were
# installed without bytecode, compile them (logged before and after: scripts/pyc_check.py).
python3 scripts/pyc_check.py --compile numpy ml_dtypes cupy cupy_backends > "$OUT/pyc_check.log" 2>&1 \
  || echo "pyc_check failed (see pyc_check.log)"
cat "$OUT/pyc_check.log"
python3 -m compileall -q -j 0 $(ls -d /tmp/site/cudnn 2>/dev/null) cudnn_attn graphs jax_bridge \
  >> "$OUT/install.log" 2>&1 || echo "compileall failed (see install.log)"
python3 -c "import cudnn, cudnn_attn; print('cuDNN', cudnn.backend_version(), 'cudnn_attn', cudnn_attn.__version__)"
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,memory.used --format=csv,noheader || true
exec python3 scripts/gpu_run.py "$@"
