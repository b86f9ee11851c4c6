"""Multi-process JAX on CPU: ``jax.distributed`` with 2 processes of 4 CPU devices each runs a jitted
training step with batch, head and sequence sharding, the ring of context parallelism crossing the
processes (``multiprocess_worker.py``), and gets what one process with all 8 devices gets from the same
program and seeds; both match the unsharded call.  And several processes filling one plan store at once.

Every subprocess runs under a watchdog (``communicate(timeout=...)``): a hang fails the test.
Tolerance: the split call against the unsharded one, the float16 tolerance of ``test_jax_common``
(``test_context_parallel``'s); one process against two, exact (the same program on the same numbers).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_common import assert_close

from cudnn_attn import MaskType
from cudnn_attn import jax_bridge as jb

WORKER = Path(__file__).with_name("multiprocess_worker.py")
WATCHDOG = 240              # seconds for each subprocess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(commands: list[list[str]]) -> None:
    """Start every command, wait for all under the watchdog; fail with their output otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=WORKER.parent) for c in commands]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=WATCHDOG)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a process did not finish within {WATCHDOG} s (hang): {commands}")
    failed = [(c, o[-3000:]) for p, c, o in zip(procs, commands, outputs) if p.returncode != 0]
    assert not failed, failed


def _expected() -> dict[str, np.ndarray]:
    """The unsharded call on the worker's inputs (same seeds), in this process."""
    rng = np.random.default_rng(70)
    B, T, N, K, H = 2, 64, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float16)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float16) for _ in range(2))
    weight = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float16)

    def loss(q, k, v):
        out = jb.dot_product_attention(q, k, v, scale=0.25, mask_type=MaskType.CAUSAL)
        return jnp.sum(out.astype(jnp.float32) * weight.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return dict(zip(("output", "dq", "dk", "dv"), (np.asarray(x, np.float32) for x in (out, *grads))))


def test_two_processes_train_like_one(tmp_path):
    port = str(_free_port())
    two, one = tmp_path / "two.npz", tmp_path / "one.npz"
    _run([[sys.executable, str(WORKER), str(rank), "2", port, "4", str(two)] for rank in (0, 1)])
    _run([[sys.executable, str(WORKER), "0", "1", "0", "8", str(one)]])
    got, alone, expected = np.load(two), np.load(one), _expected()
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], alone[name], err_msg=f"{name}: 2 processes against 1")
        assert_close(got[name], want, "float16", f"{name} (2 processes against the unsharded call)",
                     factor=1 if name == "output" else 2)


WRITER = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("error")
    from cudnn_attn.core.config import AttentionConfig
    from cudnn_attn.core.environment import Environment
    from cudnn_attn.persist.store import PlanKey, PlanStore
    env = Environment(91900, (9, 0), "NVIDIA H200", 132, "1.32.0")
    store, writer = PlanStore(sys.argv[1]), int(sys.argv[2])
    def key(q_len):
        return PlanKey(AttentionConfig(batch=1, q_heads=4, kv_heads=4, q_len=q_len, kv_len=q_len, qk_dim=64,
                                       v_dim=64, dtype="float16", scale=0.125), "fwd", "heuristic", env)
    for q_len in [128] + [256 * (writer + 1) + i for i in range(10)]:      # one shared entry, ten of its own
        payload = bytes([writer, q_len % 256]) * 50000
        assert store.save(key(q_len), payload, {"writer": writer}) is not None
        entry = store.load(key(q_len))
        assert entry is not None and entry.payload[2:] == entry.payload[:-2], "a reader saw a partial entry"
    print("ok")
""")


def test_processes_filling_one_plan_store_at_once_all_succeed(tmp_path):
    folder = tmp_path / "plans"
    _run([[sys.executable, "-c", WRITER, str(folder), str(writer)] for writer in range(4)])
    names = sorted(p.name for p in folder.iterdir())
    assert len(names) == 1 + 4 * 10 and not [n for n in names if n.startswith(".tmp-")], names
