#!/usr/bin/env bash
# Set up .venv (the project with its [cudnn] extra: the cuDNN 9.19 runtime libraries) and run the demo: cuDNN
# attention on the GPU when there is one, the NumPy reference (and the JAX bridge on CPU) when there is not.
source "$(dirname "$0")/_venv.sh" cudnn
"$PY" -m cudnn_attn.tools.demo "$@"
