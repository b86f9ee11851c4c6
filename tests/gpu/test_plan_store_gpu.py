"""Plans from the persistent store on the GPU: a deserialized plan computes exactly what the freshly
built one computes (forward, and the deterministic backward), through the frontend's execute and the
fast launch; a plan built deviceless for the H200 (as ``precompile --target sm90`` does on a CPU
machine) is found under this GPU's key and runs bit-identically; a dynamic-shape plan from the
kernel cache agrees with the static one within the tier's tolerance.

The graphs are driven directly (``graphs.build_graph`` / ``graphs.persist.build_or_load`` with an own
cuDNN handle), so these tests hold whatever the public call path does with the store.
"""

from __future__ import annotations

import numpy as np
import pytest

from cudnn_attn import MaskType
from cudnn_attn.core.environment import Environment
from cudnn_attn.engine.launch import Launcher
from cudnn_attn.graphs import BuiltGraph, DevicelessTarget, TensorId, build_graph
from cudnn_attn.persist.build import build_or_load, environment_for
from cudnn_attn.persist.store import PlanStore

from ._checks import io_dtype, make_config

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CASES = {
    "causal-fp16": dict(mask_type=MaskType.CAUSAL),
    "padding-causal-bf16-BNTH": dict(mask_type=MaskType.PADDING_CAUSAL, dtype="bfloat16", layout="BNTH"),
    "gqa-8:2-bias-fp16": dict(N=8, K=2, bias_shape=(1, 8, 128, 128)),
    "mla-192:128-bf16": dict(H=192, Hv=128, dtype="bfloat16", mask_type=MaskType.CAUSAL),
}


@pytest.fixture(scope="module")
def handle():
    import cudnn

    cp.cuda.runtime.setDevice(0)
    stream = cp.cuda.Stream(non_blocking=True)
    h = cudnn.create_handle()
    cudnn.set_stream(h, stream.ptr)
    yield h, stream
    stream.synchronize()


def _buffers(built: BuiltGraph, rng: np.random.Generator) -> dict[TensorId, object]:
    """A CuPy array per tensor of the graph: random inputs, NaN-filled outputs, valid lengths."""
    c = built.config
    io = io_dtype(c.dtype)
    shapes = {TensorId.Q: c.q_shape, TensorId.K: c.k_shape, TensorId.V: c.v_shape, TensorId.O: c.o_shape,
              TensorId.DO: c.o_shape, TensorId.DQ: c.q_shape, TensorId.DK: c.k_shape, TensorId.DV: c.v_shape,
              TensorId.STATS: (c.batch, c.q_heads, c.q_len, 1)}
    if c.bias is not None:
        shapes[TensorId.BIAS] = shapes[TensorId.DBIAS] = c.bias.shape
    # O is the forward's output but an input of the backward (a NaN O made the whole dQ NaN on the H200).
    outputs = {TensorId.O, TensorId.STATS} if built.kind == "fwd" else {TensorId.DQ, TensorId.DK, TensorId.DV,
                                                                        TensorId.DBIAS}
    arrays = {}
    for tid in built.uids:
        if tid in (TensorId.SEQ_LEN_Q, TensorId.SEQ_LEN_KV):
            length = c.q_len if tid is TensorId.SEQ_LEN_Q else c.kv_len
            arrays[tid] = cp.asarray(rng.integers(length // 2, length + 1, c.batch).astype(np.int32))
        elif tid in outputs:
            arrays[tid] = cp.full(shapes[tid], np.nan, np.float32 if tid is TensorId.STATS else io)
        elif tid is not TensorId.STATS:
            arrays[tid] = cp.asarray(rng.standard_normal(shapes[tid]).astype(io))
    if TensorId.STATS in built.uids and TensorId.STATS not in outputs:
        arrays[TensorId.STATS] = _unmasked_logsumexp(c, arrays)
    return arrays


def _unmasked_logsumexp(c, arrays: dict) -> object:
    """The backward's logsumexp input: that of the unmasked scores, an upper bound of the masked one, so
    that every probability the backward recomputes is at most 1.  (A logsumexp drawn at random made
    exp(S - lse) overflow float16 in dS and the whole dQ NaN on the H200.)"""
    def heads_first(x):
        x = x.astype(cp.float32)
        return x if c.layout.name == "BNTH" else x.transpose(0, 2, 1, 3)
    q, k = heads_first(arrays[TensorId.Q]), heads_first(arrays[TensorId.K])
    k = cp.repeat(k, c.q_heads // c.kv_heads, axis=1)
    scores = c.scale * q @ k.transpose(0, 1, 3, 2)
    if TensorId.BIAS in arrays:
        scores = scores + arrays[TensorId.BIAS].astype(cp.float32)
    top = scores.max(axis=-1, keepdims=True)
    return (top + cp.log(cp.exp(scores - top).sum(axis=-1, keepdims=True))).astype(cp.float32)


def _run(built: BuiltGraph, arrays: dict, handle, *, fast: bool) -> dict[TensorId, np.ndarray]:
    """Run ``built`` on copies of ``arrays``; the outputs, on the host."""
    h, stream = handle
    with stream:
        copies = {tid: a.copy() for tid, a in arrays.items()}
        workspace = cp.empty(max(built.workspace_size, 1), cp.uint8)
    cp.cuda.runtime.deviceSynchronize()        # the inputs were written on the default stream
    pointers = {tid: a.data.ptr for tid, a in copies.items()}
    if fast:
        launcher = Launcher(built)
        assert launcher.path == "fast", (
            f"the {built.origin} graph does not take the fast launch path (launch.py needs the deserialized-plan case)")
        launcher(pointers, workspace.data.ptr, h)
    else:
        built.execute(pointers, workspace.data.ptr, h)
    stream.synchronize()
    written = [TensorId.O, TensorId.STATS] if built.kind == "fwd" else [TensorId.DQ, TensorId.DK, TensorId.DV]
    written += [TensorId.DBIAS] if TensorId.DBIAS in copies else []
    return {tid: cp.asnumpy(copies[tid]) for tid in written}


def _assert_identical(got: dict, want: dict, what: str) -> None:
    for tid, expected in want.items():
        assert got[tid].tobytes() == expected.tobytes(), (
            f"{what}: {tid.name} differs (max |diff| "
            f"{np.nanmax(np.abs(got[tid].astype(np.float64) - expected.astype(np.float64))):.3g})")


def _config(case: str, kind: str):
    # The backward is compared bit for bit: cuDNN's deterministic dQ accumulation makes reruns identical.
    return make_config(**CASES[case], deterministic=kind == "bwd")


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_deserialized_plan_computes_exactly_what_the_built_one_does(case, kind, handle, tmp_path):
    seed = sum(map(ord, case + kind))
    rng = np.random.default_rng(seed)
    config = _config(case, kind)
    store = PlanStore(tmp_path / "plans")
    built = build_or_load(config, kind, handle[0], store=store)
    loaded = build_or_load(config, kind, handle[0], store=store)
    assert (built.origin, loaded.origin) == ("built", "loaded"), f"seed {seed}"
    assert (loaded.plan_name, loaded.workspace_size, dict(loaded.uids)) == (
        built.plan_name, built.workspace_size, dict(built.uids))
    arrays = _buffers(built, rng)
    reference = _run(built, arrays, handle, fast=False)
    for tid, result in reference.items():      # outputs start as NaN; rows past the lengths may stay so
        assert np.isfinite(result.astype(np.float64)).mean() > 0.5, f"{tid.name} not written (seed {seed})"
    _assert_identical(_run(built, arrays, handle, fast=False), reference, f"built graph rerun (seed {seed})")
    _assert_identical(_run(loaded, arrays, handle, fast=False), reference, f"loaded graph, frontend (seed {seed})")
    _assert_identical(_run(loaded, arrays, handle, fast=True), reference, f"loaded graph, fast launch (seed {seed})")


def _is_h200() -> bool:
    env = Environment.detect(0)
    return (env.compute_capability, env.device_name) == ((9, 0), "NVIDIA H200")


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_a_plan_built_deviceless_for_the_h200_is_found_and_runs_here(kind, handle, tmp_path):
    if not _is_h200():
        pytest.skip("the deviceless target describes the H200")
    seed = 1234 if kind == "fwd" else 4321
    config = _config("causal-fp16", kind)
    store = PlanStore(tmp_path / "plans")
    target = DevicelessTarget.h200()
    aot = build_or_load(config, kind, target, store=store)
    assert aot.origin == "built"
    device_env, aot_env = environment_for(handle[0]), environment_for(target)
    assert device_env == aot_env, f"this H200's plan key differs from the deviceless one:\n{device_env}\n{aot_env}"
    loaded = build_or_load(config, kind, handle[0], store=store)
    assert loaded.origin == "loaded" and loaded.plan_name == aot.plan_name
    fresh = build_graph(config, kind, handle[0])
    arrays = _buffers(fresh, np.random.default_rng(seed))
    _assert_identical(_run(loaded, arrays, handle, fast=False), _run(fresh, arrays, handle, fast=False),
                      f"deviceless-built {kind} plan (seed {seed}; plans {loaded.plan_name} / {fresh.plan_name})")


PRELOADED_CHILD = """
import os, sys, json
import cudnn_attn
from cudnn_attn.engine import preload
from cudnn_attn.tools import selftest
preload.wait()
rows = selftest.run(seed=int(sys.argv[1]), only=["bf16 BNTH causal"])
mapped = {}
for line in open("/proc/self/maps"):
    fields = line.rstrip("\\n").split(maxsplit=5)
    if len(fields) == 6 and os.path.basename(fields[5]).startswith("libcudnn"):
        mapped.setdefault(os.path.basename(fields[5]).split(".so")[0], set()).add(fields[5])
plans = sorted({row.plan for row in cudnn_attn.graph_cache.entries()})
print(json.dumps({"loaded": [os.path.basename(p).split(".so")[0] for p in preload.engines_loaded],
                  "files": {stem: sorted(paths) for stem, paths in mapped.items()},
                  "rows": [(r.status, r.detail) for r in rows], "plans": plans}))
"""


def test_a_new_process_with_preloaded_engine_libraries_computes_from_the_store(tmp_path):
    # The import's thread loads cuDNN's engine libraries by path; cuDNN must then use those (one file per
    # library in the process) and compute what the reference does, from built plans and from stored ones.
    import json
    import os
    import subprocess
    import sys

    from cudnn_attn.engine.preload import ENGINE_LIBRARIES

    env = dict(os.environ, CUDNN_ATTN_CACHE_DIR=str(tmp_path), CUDNN_ATTN_PRELOAD="1")
    env.pop("CUDNN_ATTN_PRELOAD_ENGINES", None)
    reports = []
    for seed in (5, 6):             # the first process builds and stores the plans, the second loads them
        out = subprocess.run([sys.executable, "-c", PRELOADED_CHILD, str(seed)], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, f"seed {seed}: {out.stderr[-2000:]}"
        reports.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for seed, report in zip((5, 6), reports):
        assert report["loaded"] == list(ENGINE_LIBRARIES), report
        assert all(len(paths) == 1 for paths in report["files"].values()), report["files"]
        assert set(ENGINE_LIBRARIES) <= set(report["files"]), report["files"]
        assert report["rows"] == [["ok", ""]], f"seed {seed}: {report['rows']}"
    assert reports[0]["plans"] and not any("(loaded)" in p for p in reports[0]["plans"]), reports[0]["plans"]
    assert reports[1]["plans"] and all("(loaded)" in p for p in reports[1]["plans"]), reports[1]["plans"]
