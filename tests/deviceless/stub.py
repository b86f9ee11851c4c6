"""The stub ``libcuda.so.1`` of the deviceless tier: see :mod:`cudnn_attn.graphs.driver_stub`."""

from cudnn_attn.graphs.driver_stub import (  # noqa: F401 -- re-exported for conftest.py
    build_stub,
    c_compiler,
    cudnn_library_dir,
    driver_entry_points,
    real_driver_present,
    stub_source,
)
