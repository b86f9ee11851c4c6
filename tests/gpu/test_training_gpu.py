"""Training as users run it: a jitted transformer step on one and two GPUs, under a watchdog.

Each run is ``benchmarks/train_step.py`` in a subprocess: a small causal transformer (2 layers,
d_model 512, 8 heads, T=512, batch 8 sharded over ``("dp",)``), ``lax.scan`` over ``jax.checkpoint``-ed
layers, ``value_and_grad``, SGD, donated parameters, 5 steps.  The script's watchdog dumps every
thread's stack and exits when a run does not finish in time, so a hang (the bug this guards: cuDNN
handles created inside the FFI handler while the other GPU waited in a collective) fails the test with
the stacks instead of blocking the suite.

Losses are compared with the same model using ``jax.nn.dot_product_attention(implementation="cudnn")``
(relative 2e-3: bf16 training, different cuDNN plans may round differently).  On two GPUs the jitted
step is also evaluated from 4 Python threads at once (every result equal to the single-thread one),
and the attention runs inside ``shard_map`` followed by a ``psum``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_step.py")
WATCHDOG = 150


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _train(*args: str) -> dict:
    command = [sys.executable, SCRIPT, "--watchdog", str(WATCHDOG), *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=WATCHDOG + 60)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"{' '.join(args)}: no result after {WATCHDOG + 60} s (the watchdog did not fire either)\n"
                    f"{timeout.stderr}")
    if done.returncode != 0:
        pytest.fail(f"{' '.join(args)}: exit code {done.returncode} (3: the watchdog fired - a hang; stacks below)\n"
                    f"{done.stderr[-12000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference_losses() -> dict:
    return {}


def _jax_run(gpus: int, cache: dict) -> dict:
    if gpus not in cache:
        cache[gpus] = _train("--impl", "jax", "--gpus", str(gpus), *(["--shard-map"] if gpus == 2 else []))
    return cache[gpus]


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("cuda_graph", ["on", "off"])
def test_training_step_matches_jax_nn(gpus, cuda_graph, reference_losses):
    if _gpu_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs (the 2-GPU H200 machine)")
    extra = ["--threads", "4", "--shard-map"] if gpus == 2 and cuda_graph == "on" else []
    ours = _train("--impl", "ours", "--gpus", str(gpus), "--cuda-graph", cuda_graph, *extra)
    want = _jax_run(gpus, reference_losses)
    assert np.all(np.isfinite(ours["losses"])), ours
    np.testing.assert_allclose(ours["losses"], want["losses"], rtol=2e-3,
                               err_msg=f"losses of cudnn_attn vs jax.nn cuDNN ({gpus} GPU, cuda_graph={cuda_graph})")
    assert ours["losses"][-1] < ours["losses"][0], "the loss must go down under SGD"
    if extra:
        assert ours["threads_equal"], "4 threads evaluating the jitted step at once disagree with one thread"
        np.testing.assert_allclose(ours["shard_map_psum"], want["shard_map_psum"], rtol=1e-2,
                                   err_msg="shard_map + psum of the attention output vs jax.nn")
