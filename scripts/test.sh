#!/usr/bin/env bash
# CI and local runs. 1) Set up .venv (Python 3.12, jax pinned as on the GPU machine) and run the whole
# CPU test suite, including the deviceless cuDNN tier. 2) Run the tests that touch JAX or score_mod, and
# the fuzz test of the front doors, against the newest JAX release in .venv-jax-latest, set up the same way.
# 3) Run the whole suite again on Python 3.11 (the oldest the package supports) in .venv-py311: jax 0.10.2,
# the newest JAX for it, and torch's CPU build with transformers, so the torch front's CPU tests run too.
# Extra arguments go to pytest in every run; naming test files or ids (a focused run) skips the second and
# third unless CUDNN_ATTN_JAX_LATEST=1 / CUDNN_ATTN_PY311=1 (=0 always skips them); without a python3.11 the
# third is skipped, saying so. Exits non-zero when any run fails.
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
status=0
"$PY" -m pytest "$@" || status=$?

# A focused run (it names test files or ids) runs in .venv alone unless a variable asks for more.
whole=1
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
  "$latest/bin/python" -m pytest "$@" tests/test_jax_*.py tests/test_score_mod*.py tests/test_values.py \
    tests/test_fuzz_front_doors.py || status=$?
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
    "$venv311/bin/python" -m pytest "$@" || status=$?
  fi
fi
exit $status
