"""Device memory of the paths that churn in a long run, on the GPU: graphs evicted from the graph cache and
rebuilt, and replay graphs replaced for new addresses.  On an H200 with cuDNN 9.19 neither left memory behind:
8,800 evictions and rebuilds kept device memory outside CuPy's pool at one reading, and 6,664 replay graphs
replaced either way (updated in place, or destroyed and instantiated) left 0 MiB.  The bound here is two of
the driver's 2 MiB pages, over far fewer calls; every result is compared against the reference."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
import time

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, reference
from cudnn_attn.core import settings
from cudnn_attn.engine import cache as cache_module
from cudnn_attn.engine.cache import GraphCache

from ._checks import assert_close

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

MIB = 1 << 20
GROWTH_MIB = 4.0            # two of the driver's 2 MiB pages
WATCHDOG_S = 180.0          # a loop stops here even short of its calls; the memory bound still applies


class _ProcessInfo(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong), ("gpu_instance", ctypes.c_uint),
                ("compute_instance", ctypes.c_uint)]                    # NVML's nvmlProcessInfo_t


def _process_device_bytes() -> int | None:
    """Device memory this process holds on the current GPU, by NVML (other processes on the GPU, such as
    the tier's other pytest workers, do not count); ``None`` where NVML cannot say."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        bus_id = cp.cuda.Device().pci_bus_id.encode()
        if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id, ctypes.byref(handle)) != 0:
            return None
        count, infos = ctypes.c_uint(64), (_ProcessInfo * 64)()
        if nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(count), infos) != 0:
            return None
    except (OSError, AttributeError):
        return None
    mine = [info.used for info in infos[:count.value] if info.pid == os.getpid()]
    return mine[0] if mine else None


def _outside_pool_mib() -> float:
    """Device memory this process holds outside CuPy's pool, after a synchronise and with CuPy's free blocks
    returned: NVML's count for this process, or, where NVML cannot say and no other pytest worker shares the
    GPU, the device's whole use (``cudaMemGetInfo``)."""
    pool = cp.get_default_memory_pool()
    cp.cuda.runtime.deviceSynchronize()
    pool.free_all_blocks()
    used = _process_device_bytes()
    if used is None:
        if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
            pytest.skip("NVML cannot count this process's device memory, and other pytest workers share the GPU")
        free, total = cp.cuda.runtime.memGetInfo()
        used = total - free
    return (used - pool.total_bytes()) / MIB


@pytest.fixture
def small_cache(monkeypatch):
    """A 4-graph cache in place of the library's, wherever a module refers to it."""
    old, new = cache_module.graph_cache, GraphCache(4)
    for name, module in list(sys.modules.items()):
        if name.startswith("cudnn_attn") and getattr(module, "graph_cache", None) is old:
            monkeypatch.setattr(module, "graph_cache", new)
    return new


def _bf16(rng, shape):
    import ml_dtypes

    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def test_evicted_and_rebuilt_graphs_leave_no_device_memory(small_cache):
    """Eight configurations forward and backward through a 4-graph cache: every lookup evicts and rebuilds."""
    rng = np.random.default_rng(211)
    cases = []
    for length in (256, 384, 512, 640):
        for mask in (MaskType.NO_MASK, MaskType.CAUSAL):
            host = [_bf16(rng, (2, length, 8, 64)) for _ in range(4)]
            cases.append((host, [cp.asarray(x) for x in host], mask))
    kwargs = dict(scale=0.125)

    def step(i):
        _, (q, k, v, do), mask = cases[i % len(cases)]
        o, lse = cudnn_attn.dot_product_attention(q, k, v, mask_type=mask, return_residual=True, **kwargs)
        return o, cudnn_attn.dot_product_attention_bwd(q, k, v, o, do, lse, mask_type=mask, **kwargs)

    for i in range(2 * len(cases)):                  # every graph built once, and in the plan store
        step(i)
    before, misses, start, i = _outside_pool_mib(), small_cache.stats().misses, time.monotonic(), 0
    while i < 40 * len(cases) and time.monotonic() - start < WATCHDOG_S:
        o, grads = step(i)
        i += 1
    after, rebuilds = _outside_pool_mib(), small_cache.stats().misses - misses
    reproduce = f"reproduce: pytest tests/gpu/test_memory_gpu.py -k rebuilt  ({i} steps, {rebuilds} rebuilds)"
    assert rebuilds >= i, f"the 4-graph cache did not rebuild on every lookup ({reproduce})"
    assert after - before <= GROWTH_MIB, f"device memory outside the pool {before:.1f} -> {after:.1f} MiB ({reproduce})"
    host, _, mask = cases[(i - 1) % len(cases)]
    want_o, want_lse = reference.dot_product_attention(*host[:3], mask_type=mask, return_residual=True, **kwargs)
    want = reference.dot_product_attention_bwd(*host[:3], want_o, host[3], want_lse, mask_type=mask, **kwargs)
    assert_close("output of the last rebuilt forward", o, want_o, "bfloat16")
    assert_close("dq of the last rebuilt backward", grads.dq, want.dq, "bfloat16")


@pytest.mark.parametrize("recycle", [True, False], ids=["updated_in_place", "destroyed_and_instantiated"])
def test_replay_graphs_replaced_for_new_addresses_leave_no_device_memory(recycle, monkeypatch):
    """A bound forward with a bound of 2 replay graphs and 6 result buffers in a cycle: every call replaces a
    graph, by ``cudaGraphExecUpdate`` or by destroying and instantiating one."""
    from cudnn_attn.engine import replay

    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_graphs_per_plan=2))
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_patience=10 ** 6))
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_recycle=recycle))
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_graphs=10 ** 6))     # other tests' graphs must not stop the captures
    rng = np.random.default_rng(223 if recycle else 227)
    host = [_bf16(rng, (1, 256, 8, 64)) for _ in range(3)]
    q, k, v = (cp.asarray(x) for x in host)
    kwargs = dict(scale=0.125, mask_type=MaskType.CAUSAL)
    bound = cudnn_attn.bind(q, k, v, **kwargs)
    buffers = [cp.empty_like(q) for _ in range(6)]
    for i in range(2 * len(buffers)):
        bound(q, k, v, out=buffers[i % len(buffers)])
    before, churn, start, i = _outside_pool_mib(), replay.churn(), time.monotonic(), 0
    while i < 3000 and time.monotonic() - start < WATCHDOG_S:
        buffers[i % len(buffers)].fill(np.nan)
        bound(q, k, v, out=buffers[i % len(buffers)])
        i += 1
    after, now = _outside_pool_mib(), replay.churn()
    replaced = (now.updated - churn.updated) if recycle else (now.destroyed - churn.destroyed)
    reproduce = f"reproduce: pytest tests/gpu/test_memory_gpu.py -k {'in_place' if recycle else 'destroyed'}"
    assert replaced >= i // 4, f"{replaced} graphs replaced in {i} calls: the churn did not happen ({reproduce})"
    assert after - before <= GROWTH_MIB, f"device memory outside the pool {before:.1f} -> {after:.1f} MiB ({reproduce})"
    want = reference.dot_product_attention(*host, **kwargs)
    for j, buffer in enumerate(buffers):
        assert_close(f"buffer {j} after the churn", buffer, want, "bfloat16")
