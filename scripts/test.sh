#!/usr/bin/env bash
# Set up .venv (Python 3.12, the project with its test extra) and run the whole CPU test suite,
# including the deviceless cuDNN tier. Extra arguments go to pytest.
source "$(dirname "$0")/_venv.sh" test
"$PY" -m pytest "$@"
