"""GPU tier: every test here needs an NVIDIA GPU with cuDNN; it is skipped cleanly elsewhere.

Run on the GPU machine with ``scripts/gpu_run.sh`` (``pytest -m gpu``).
"""

import pytest

from cudnn_attn import runtime


def pytest_collection_modifyitems(config, items):
    if runtime.is_gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU: the gpu tier runs on the GPU machine (scripts/gpu_run.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
