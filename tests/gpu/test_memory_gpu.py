"""Device memory of the paths that churn in a long run, on the GPU: graphs evicted from the graph cache and
rebuilt, and replay graphs replaced for new addresses.  On an H200 with cuDNN 9.19 neither left memory behind:
8,800 evictions and rebuilds kept device memory outside CuPy's pool at one reading, and 6,664 replay graphs
replaced either way (updated in place, or destroyed and instantiated) left 0 MiB.  The bound here is two of
the driver's 2 MiB pages, over far fewer calls; every result is compared against the reference."""

from __future__ import annotations

import time

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, reference
from cudnn_attn.engine import cache as cache_module
from cudnn_attn.engine.cache import GraphCache

from ._checks import assert_close

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

MIB = 1 << 20
GROWTH_MIB = 4.0            # two 2 MiB pages of cudaMemGetInfo
WATCHDOG_S = 180.0          # a loop stops here even short of its calls; the memory bound still applies


def _outside_pool_mib() -> float:
    """Device memory in use outside CuPy's pool, after a synchronise and with CuPy's free blocks returned."""
    pool = cp.get_default_memory_pool()
    cp.cuda.runtime.deviceSynchronize()
    pool.free_all_blocks()
    free, total = cp.cuda.runtime.memGetInfo()
    return (total - free - pool.total_bytes()) / MIB


@pytest.fixture
def small_cache(monkeypatch):
    """A 4-graph cache in place of the library's, wherever a module refers to it."""
    import sys

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

    monkeypatch.setattr(replay, "CAPACITY", 2)
    monkeypatch.setattr(replay, "PATIENCE", 10 ** 6)
    monkeypatch.setattr(replay, "RECYCLE", recycle)
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
