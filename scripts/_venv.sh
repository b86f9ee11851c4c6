# Sourced by demo.sh / test.sh: create (or reuse) .venv with Python 3.12 and install the project.
# Python 3.12 + jax 0.11.2 is what CI and the GPU machine run; any Python >= 3.11 works for users.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv="${CUDNN_ATTN_VENV:-$root/.venv}"

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

extras="$1"   # e.g. "test" or ""
stamp="$venv/.cudnn_attn-installed-$(cat pyproject.toml scripts/constraints.txt | sha1sum | cut -c1-12)-${extras:-none}"
if [ ! -x "$venv/bin/python" ]; then
  python=$(pick_python)
  "$python" -m venv "$venv"
fi
if [ ! -e "$stamp" ]; then
  spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q -c scripts/constraints.txt -e "$spec"
  rm -f "$venv"/.cudnn_attn-installed-*
  touch "$stamp"
fi
PY="$venv/bin/python"
