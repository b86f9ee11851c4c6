"""The graph cache on the GPU: why real cuDNN builds missed, one entry's detail, and a compiled JAX program named
as holding its plan (the CPU tests, ``tests/test_cache.py``, use a fake builder and fake call sites); and the
graph-cache notebook run on the GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_attn import MaskType, jax_bridge, reference
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine.cache import GraphCache, graph_cache
from cudnn_attn.jax_bridge import cudnn_target
from cudnn_attn.jax_bridge.call_site import AttentionCall, registry

from ._checks import assert_close

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

H = 64
SCALE = H ** -0.5
ROOT = Path(__file__).resolve().parents[2]


def _inputs(rng: np.random.Generator, length: int) -> tuple[np.ndarray, ...]:
    """Seeded float16 Q, K, V of shape (2, length, 3, 64): three heads, a shape no other GPU test uses."""
    return tuple(rng.standard_normal((2, length, 3, H)).astype(np.float16) for _ in range(3))


def test_real_builds_record_why_they_missed_and_show_their_detail():
    rng = np.random.default_rng(61)
    cache = GraphCache(maxsize=2)                  # the default builder: support check, plan store, cuDNN on GPU 0
    configs = [validate_call(*_inputs(rng, t), scale=SCALE, mask_type=MaskType.CAUSAL)[0] for t in (200, 201)]
    plans = [cache.plan(c, "fwd", 0) for c in configs]
    first, second = cache.misses()
    assert first.cause == "nothing cached" and first.number == 0
    assert (second.changes, second.nearest, second.number) == (("T 200→201", "S 200→201"), 0, 1), second
    for number, plan in enumerate(plans):
        detail, built = cache.entry_detail(number), plan.built
        assert detail.origin == built.origin and cache.misses()[number].outcome == built.origin, detail
        assert detail.plan.startswith(built.plan_name) and re.fullmatch(r"engine \d+", detail.engine), detail
        assert detail.workspace_bytes == built.workspace_size and detail.held_by == ()
        assert detail.graph == built.describe()
        if built.origin == "built":
            assert '"nodes": []' not in detail.graph           # a built graph's JSON has its nodes


def test_a_compiled_jax_program_is_named_as_holding_its_plan():
    rng = np.random.default_rng(67)
    q, k, v = _inputs(rng, 203)
    args = tuple(jnp.asarray(x) for x in (q, k, v))
    program = jax.jit(lambda q, k, v: jax_bridge.dot_product_attention(
        q, k, v, scale=SCALE, mask_type=MaskType.CAUSAL)).lower(*args).compile()
    want = reference.dot_product_attention(q, k, v, scale=SCALE, mask_type=MaskType.CAUSAL)
    assert_close("output", np.asarray(program(*args)), want, "float16")
    config, _ = validate_call(*args, scale=SCALE, mask_type=MaskType.CAUSAL, xp=jnp)
    site = registry.key(AttentionCall(config, "fwd", 0))
    entry_key = graph_cache.key(config, "fwd", 0)
    detail = graph_cache.entry_detail(entry_key)
    assert cudnn_target.pinned_plan(site, 0) is graph_cache.entry(entry_key).plan
    mine = [h for h in detail.held_by if h.startswith(f"JAX call site {site} on device 0: ")]
    assert len(mine) == 1 and int(re.search(r": (\d+) live executable", mine[0]).group(1)) >= 1, detail.held_by
    assert next(r.held for r in graph_cache.entries() if r.index == detail.number) >= 1
    del program


def test_the_notebook_runs_on_the_gpu():
    """``tests/test_notebook.py`` in a fresh process: on this machine its checks take the GPU branch (cuDNN builds
    and runs the graphs, a relative error against the reference within the float16 bound, the JAX program's call
    site named as holding its plan)."""
    pytest.importorskip("nbclient", reason="the notebook needs nbclient, nbformat, ipykernel (the test extra)")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_notebook.py")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0 and " passed" in result.stdout and "skipped" not in result.stdout, \
        f"{' '.join(command)}\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
