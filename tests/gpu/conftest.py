"""GPU tier: every test here needs an NVIDIA GPU with cuDNN; it is skipped cleanly elsewhere.

Run on the GPU machine with ``benchmarks/run_all.sh`` (``pytest -m gpu``).
"""

import pytest

from cudnn_attn.engine import runtime


def pytest_collection_modifyitems(config, items):
    if runtime.is_gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU: the gpu tier runs on the GPU machine (benchmarks/run_all.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _start_on_gpu_0():
    """Each test starts with GPU 0 current.  XLA leaves the calling thread's current device at the last
    GPU it ran on (seen on the 2-GPU H200 machine after the sharding test), and CuPy allocates new
    arrays on the thread's current device."""
    if runtime.is_gpu_available():
        import cupy

        cupy.cuda.runtime.setDevice(0)
    yield
