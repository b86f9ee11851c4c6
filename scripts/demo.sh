#!/usr/bin/env bash
# Set up .venv and run the demo: cuDNN attention on the GPU when there is one, the NumPy reference
# (and the JAX bridge on CPU) when there is not.
source "$(dirname "$0")/_venv.sh" ""
"$PY" -m cudnn_attn.tools.demo "$@"
