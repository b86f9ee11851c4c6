"""Lifetimes on the JAX side: call-site entries and the GPU handler's plans are held by live
executables (XLA's instantiate stage and its state deleter) and by recent lowerings, and released when
neither holds them.  CPU: the reference target runs the same lowering and instantiate path as the GPU."""

from __future__ import annotations

import ctypes
import gc
import logging
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ffi_frames import HostCallFrame

from cudnn_attn import jax_bridge
from cudnn_attn.jax_bridge import cudnn_target, ffi
from cudnn_attn.jax_bridge.call_site import Holds, registry


def test_holds_release_what_neither_recent_use_nor_a_pin_holds():
    released = []
    holds = Holds(lambda: 2, released.append)
    holds.releasing = True
    unpin = holds.pin(1)
    for key in (1, 2, 3):
        holds.touch(key)
    assert released == []                    # 1 left the recent two but is pinned
    unpin()
    assert released == [1]
    unpin()                                  # a second release of the same pin does nothing
    holds.touch(4)
    assert released == [1, 2]
    assert holds.counts() == {"recent": 2, "pinned": 0, "pins": 0}


def test_holds_release_nothing_until_releasing_is_set():
    released = []
    holds = Holds(lambda: 1, released.append)
    holds.pin(5)()
    for key in range(4):
        holds.touch(key)
    assert released == [] and holds.counts()["recent"] == 1


def test_the_reference_target_is_registered_with_executable_state():
    assert registry.holds.releasing, "jax.ffi.register_ffi_type is available in the tested JAX versions"


def _site(rng, scale):
    q = jnp.asarray(rng.standard_normal((1, 16, 2, 8)), jnp.float16)
    f = jax.jit(lambda q, k, v: jax_bridge.dot_product_attention(q, k, v, scale=scale))
    return f, q


def _key(scale):
    return next(k for k, call in registry._calls.items() if call.config.scale == pytest.approx(scale))


def test_executables_hold_their_call_sites_and_release_them_when_destroyed(rng, monkeypatch):
    monkeypatch.setattr(registry.holds, "_recent_size", lambda: 1)
    scales = [0.0137 + i / 997 for i in range(3)]          # call sites no other test lowers
    sites = [_site(rng, s) for s in scales]
    expected = [np.asarray(f(q, q, q)) for f, q in sites]
    keys = [_key(s) for s in scales]
    live = ffi.live_states()
    assert all(registry.holds.pins[k] == 1 for k in keys)
    assert all(k in registry._calls for k in keys), "a live executable keeps its entry past the recent lowerings"

    del sites[0]                                            # the executable of the oldest site dies
    jax.clear_caches()
    gc.collect()
    assert ffi.release_destroyed_states() >= 1, "XLA posted the state of the destroyed executable"
    assert ffi.live_states() <= live - 1
    assert keys[0] not in registry._calls, "nothing holds the oldest site: released"
    for (f, q), want in zip(sites, expected[1:]):            # the live ones still run
        np.testing.assert_array_equal(np.asarray(f(q, q, q)), want)

    again, q = _site(np.random.default_rng(0), scales[0])    # lowered again: a fresh key, same results
    np.testing.assert_array_equal(np.asarray(again(q, q, q)), np.asarray(jax.jit(
        lambda q: jax_bridge.dot_product_attention(q, q, q, scale=scales[0]))(q)))
    assert _key(scales[0]) not in keys


def test_a_run_without_instantiation_stops_releasing(monkeypatch, caplog):
    """The GPU handler's safety net: a site run by an executable XLA did not instantiate keeps every plan."""
    monkeypatch.setattr(cudnn_target.plan_holds, "releasing", True)
    monkeypatch.setattr(registry.holds, "releasing", True)
    key = 2 ** 41
    frame = HostCallFrame(key, 2, 2)
    launched = []
    cudnn_target._launches[(key, 0)] = cudnn_target.SiteLaunch(None, lambda a, s, c: launched.append(a))
    try:
        with caplog.at_level(logging.WARNING, logger="cudnn_attn"):
            cudnn_target._run(ffi.Call(frame.address))
    finally:
        del cudnn_target._launches[(key, 0)]
    assert launched and not cudnn_target.plan_holds.releasing and not registry.holds.releasing
    assert "without its instantiate stage" in caplog.text


def test_a_pin_cannot_slip_between_the_decision_to_release_and_the_release():
    """The race a soak found on the H200: a lowering re-pinned a site while another thread was dropping its plans, and
    the executable then ran without them.  The release happens under the lock, so the pin waits for it (and
    instantiation then re-plans what was dropped)."""
    import threading
    import time

    events, started = [], threading.Event()

    def release(key):
        events.append(("release", key))
        started.set()
        time.sleep(0.05)
        events.append(("released", key))

    holds = Holds(lambda: 1, release)
    holds.releasing = True
    holds.touch(7)
    evict = threading.Thread(target=holds.touch, args=(8,))     # 7 leaves the recent one: released
    evict.start()
    assert started.wait(5)
    holds.pin(7)
    events.append(("pinned", 7))
    evict.join()
    assert events == [("release", 7), ("released", 7), ("pinned", 7)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libc's unnamed semaphores: Linux")
def test_xlas_deleter_of_an_executable_state_runs_no_python():
    """XLA calls the deleter on whichever thread drops the executable, also after Python began finalizing:
    it is libc's sem_post, called here as XLA would (a foreign call, the GIL released), and the held object is
    dropped and called by the next release on a Python thread."""
    assert ffi._states.info.deleter == ctypes.cast(ctypes.CDLL(None).sem_post, ctypes.c_void_p).value
    called = []
    token = ffi._states.keep(lambda: called.append(True))
    live = ffi.live_states()
    assert called == [] and ffi.release_destroyed_states() == 0, "an unposted state is held"
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ffi._states.info.deleter)(token)
    assert ffi.release_destroyed_states() == 1 and called == [True]
    assert ffi.live_states() == live - 1
    ffi._states.discard(ffi._states.keep(lambda: called.append("discarded")))    # a state XLA refused
    assert called[-1] == "discarded" and ffi.live_states() == live - 1


def test_without_semaphores_the_deleter_is_python_and_drops_the_object_at_once(monkeypatch):
    """macOS has no unnamed semaphores: the state's deleter is then a ctypes callback (called here as XLA would)."""
    monkeypatch.setattr(ffi._Semaphores, "load", classmethod(lambda cls: None))
    states = ffi._States()
    called = []
    token = states.keep(lambda: called.append(token))
    assert len(states) == 1 and states.info.deleter != ctypes.cast(ctypes.CDLL(None).sem_post, ctypes.c_void_p).value
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(states.info.deleter)(token)
    assert called == [token] and len(states) == 0 and states.release_destroyed() == 0
    states.discard(states.keep(lambda: called.append("discarded")))
    assert called[-1] == "discarded" and len(states) == 0


def test_an_executable_destroyed_on_xlas_thread_after_the_interpreter_began_exiting_lets_it_exit(tmp_path):
    """An execution that outlives the interpreter holds its executable's last reference, so XLA destroys the
    executable on its pool thread during finalization.  With a Python deleter that thread took the GIL there and
    was ended, and the client's destructor then joined it forever (the CPU demo's exit hung that way under load;
    this script hung every time).  Watchdog: 120 s."""
    script = tmp_path / "late_executable.py"
    script.write_text(textwrap.dedent("""
        import time
        import jax, jax.numpy as jnp, numpy as np
        from cudnn_attn import jax_bridge

        q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 16, 2, 8)), jnp.float16)

        def slow(q):
            o = jax_bridge.dot_product_attention(q, q, q, scale=0.25)
            x = jnp.full((1024, 1024), 1e-3, jnp.float32) * o.astype(jnp.float32).sum()
            return jax.lax.fori_loop(0, 100, lambda i, x: jnp.tanh(x @ x), x).sum()

        jax.jit(slow)(q)      # the result and the jitted function are dropped at once
        time.sleep(0.3)       # the attention handler runs; the loop goes on past the interpreter's exit
        print("exiting", flush=True)
    """))
    try:
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the interpreter did not exit within 120 s; stdout: {exc.stdout!r}")
    assert run.returncode == 0 and "exiting" in run.stdout, run.stdout + run.stderr
