# Sourced by demo.sh / test.sh: create (or reuse) a virtual environment and install the project.
# Python 3.12 + jax 0.11.2 is what CI and the GPU machine run; any Python >= 3.11 works for users.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

pick_python() {
  # Prefer Python 3.12 (pyenv's, then the PATH's), else python3.
  local cand
  if command -v pyenv >/dev/null 2>&1; then
    for cand in "$(pyenv root)"/versions/3.12.*/bin/python3.12; do
      [ -x "$cand" ] && { echo "$cand"; return; }
    done
  fi
  command -v python3.12 || command -v python3
}

# make_venv DIR EXTRAS JAX [PYTHON]: create or reuse the environment DIR with the project installed editable
# (with the extras EXTRAS, e.g. "test", or none for ""). JAX is "pinned" (scripts/constraints.txt: the
# GPU machine's versions, or on Python 3.11 the newest for it) or "latest" (the newest jax[cpu] release;
# looked up again once a day). Every other package follows scripts/constraints.txt. PYTHON: the interpreter
# that makes a new environment (default: pick_python's). Reuse costs nothing: a stamp file records the install.
make_venv() {
  local venv=$1 extras=$2 jax=$3 python=${4:-}
  local spec=. constraints=scripts/constraints.txt day=""
  [ -n "$extras" ] && spec=".[$extras]"
  [ "$jax" = latest ] && { constraints="$venv/constraints-without-jax.txt"; day="-$(date +%F)"; }
  local stamp
  stamp="$venv/.cudnn_attn-installed-$(cat pyproject.toml scripts/constraints.txt | sha1sum | cut -c1-12)-${extras:-none}-$jax$day"
  if [ ! -x "$venv/bin/python" ]; then
    "${python:-$(pick_python)}" -m venv "$venv"
  fi
  if [ ! -e "$stamp" ]; then
    [ "$jax" = latest ] && grep -v '^jax' scripts/constraints.txt > "$constraints"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
    "$venv/bin/python" -m pip install -q -c "$constraints" -e "$spec"
    if [ "$jax" = latest ]; then
      "$venv/bin/python" -m pip install -q -c "$constraints" --upgrade "jax[cpu]"
    fi
    rm -f "$venv"/.cudnn_attn-installed-*
    touch "$stamp"
  fi
}

make_venv "${CUDNN_ATTN_VENV:-$root/.venv}" "${1-}" pinned
PY="${CUDNN_ATTN_VENV:-$root/.venv}/bin/python"
