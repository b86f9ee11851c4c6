#!/usr/bin/env bash
# The test command.  ./scripts/test.sh [PYTEST ARGS]: set up .venv (Python 3.12, jax pinned as on the GPU machine)
# and run the whole CPU suite there, including the deviceless cuDNN tier, on the machine's cores (pytest-xdist,
# -n auto; --dist worksteal: tests go to the workers one by one and an idle worker takes over another's queue, since
# a few tests take 40-50 s - whole files per worker, --dist loadfile, took 10 min 53 s on 2 cores, --dist load
# 7 min 47 s and 9 min 42 s; CUDNN_ATTN_TEST_WORKERS=N sets the workers).
# ./scripts/test.sh --all [PYTEST ARGS]: the CI matrix (.ci/run): that run, then 2) the tests that touch JAX or
# score_mod, and the fuzz test of the front doors, against the newest JAX release in .venv-jax-latest, set up the
# same way, and 3) the whole suite again on Python 3.11 (the oldest the package supports) in .venv-py311: jax
# 0.10.2, the newest JAX for it, and torch's CPU build with transformers, so the torch front's CPU tests run too.
# Other arguments go to pytest in every run (after -n, so `-n 0` runs serially); with --all, naming test files or
# ids (a focused run) skips the second and third runs unless CUDNN_ATTN_JAX_LATEST=1 / CUDNN_ATTN_PY311=1 (=0
# always skips them; =1 also adds them to a run without --all); without a python3.11 the third is skipped, saying
# so.  Each run prints its wall time.  Exits non-zero when any run fails.
matrix=0
args=()
for arg in "$@"; do
  if [ "$arg" = --all ]; then matrix=1; else args+=("$arg"); fi
done
set -- ${args[@]+"${args[@]}"}
source "$(dirname "$0")/_venv.sh" test

# tests/test_cache_browser.py renders the graph cache's HTML in headless Chromium: installed from the distribution's
# packages when missing and apt can (as root or with password-less sudo); otherwise that test skips, saying why.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || { sudo -n true 2>/dev/null && sudo="sudo -n"; } || true
  if [ "$(id -u)" = 0 ] || [ -n "$sudo" ]; then
    { $sudo apt-get install -y -q chromium || { $sudo apt-get update -q && $sudo apt-get install -y -q chromium; }; } \
      >/dev/null 2>&1 || echo "note: apt could not install chromium: tests/test_cache_browser.py will skip"
  fi
fi
parallel=(-n "${CUDNN_ATTN_TEST_WORKERS:-auto}" --dist worksteal)
status=0
timed() {   # timed NAME COMMAND...: run it, print its wall time, remember a failure
  local start=$SECONDS
  "${@:2}" || status=$?
  echo "== $1: $((SECONDS - start)) s =="
}
timed ".venv, the whole suite" "$PY" -m pytest "${parallel[@]}" "$@"

# The matrix: a focused run (it names test files or ids) runs in .venv alone unless a variable asks for more.
whole=$matrix
for arg in "$@"; do
  case "$arg" in tests*|*.py|*.py::*) whole=0 ;; esac
done
latest_run=${CUDNN_ATTN_JAX_LATEST:-auto}
[ "$latest_run" = auto ] && latest_run=$whole
py311_run=${CUDNN_ATTN_PY311:-auto}
[ "$py311_run" = auto ] && py311_run=$whole

if [ "$latest_run" = 1 ]; then
  latest="${CUDNN_ATTN_VENV_JAX_LATEST:-$root/.venv-jax-latest}"
  make_venv "$latest" test latest
  echo "== newest JAX: jax $("$latest/bin/python" -c 'import jax; print(jax.__version__)'): JAX, score_mod, values, fuzz =="
  timed "newest JAX" "$latest/bin/python" -m pytest "${parallel[@]}" "$@" tests/test_jax_*.py \
    tests/test_score_mod*.py tests/test_values.py tests/test_fuzz_front_doors.py
fi
if [ "$py311_run" = 1 ]; then
  py311=$(command -v python3.11 || true)
  if [ -z "$py311" ]; then
    echo "note: no python3.11 on PATH: the Python 3.11 run is skipped"
  else
    venv311="${CUDNN_ATTN_VENV_PY311:-$root/.venv-py311}"
    make_venv "$venv311" "test,torch" pinned "$py311"
    echo "== Python $("$venv311/bin/python" -c 'import platform; print(platform.python_version())'):" \
      "jax $("$venv311/bin/python" -c 'import jax; print(jax.__version__)'), the whole suite =="
    timed "Python 3.11, the whole suite" "$venv311/bin/python" -m pytest "${parallel[@]}" "$@"
  fi
fi
exit $status
