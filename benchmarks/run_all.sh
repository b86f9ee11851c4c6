#!/usr/bin/env bash
# Install this checkout, then benchmarks/run_all.py (GPU tests, benchmarks; summary last).
#
#   benchmarks/run_all.sh [PHASE ...] [--budget SECONDS] [--full] [--bundle]   (phases: see benchmarks/run_all.py)
#
# Logs, JUnit XML and benchmark JSON/PNG go to $OUT (default: bench_out/).  Wheels in .whl/ (for a machine
# without a package index: the cuDNN frontend's, say) are installed into /tmp/site first; the project is
# installed editable (graphs/ and jax_bridge/ map to cudnn_attn.graphs / cudnn_attn.jax_bridge, so the checkout
# alone is not importable).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-bench_out}"
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
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
# A package installed without bytecode (pip --no-compile, as the wheels above) under PYTHONDONTWRITEBYTECODE
# compiles every module it imports in every new process (tens of ms of each first call): compile the packages
# that `import cudnn_attn` and a first call import, and this checkout, once, as an install does (where writable).
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}" >> "$OUT/install.log"
python3 -m compileall -q -j 0 $(python3 -c "
import importlib.util
for name in ('cudnn', 'numpy', 'ml_dtypes', 'cupy', 'cupy_backends'):
    spec = importlib.util.find_spec(name)
    print(*(spec.submodule_search_locations or ()) if spec else ())") cudnn_attn graphs jax_bridge \
  >> "$OUT/install.log" 2>&1 || echo "compileall failed for a folder (see install.log)"
python3 -c "import cudnn, cudnn_attn; print('cuDNN', cudnn.backend_version(), 'cudnn_attn', cudnn_attn.__version__)"
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,memory.used --format=csv,noheader || true
exec python3 benchmarks/run_all.py "$@"
