"""The ctypes XLA FFI layer on CPU: zero-copy buffers, attributes, dtypes, errors, the call-site registry,
and the GPU handler's Python on a call frame in host memory."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_attn import jax_bridge  # noqa: F401  (registers the attention targets)
from cudnn_attn.jax_bridge import ffi
from cudnn_attn.jax_bridge.call_site import AttentionCall, CallRegistry

seen: dict = {}


def _axpy(call: ffi.Call) -> None:
    """out = alpha * x + y, recording what the handler saw."""
    (x, y), (out,) = call.args, call.rets
    attributes = call.attributes()
    seen.update(args=call.args, rets=call.rets, attributes=attributes, addresses=call.arg_addresses())
    if len(attributes) == 1:
        seen["fast"] = call.addresses_and_key()
    ffi.host_array(out, writeable=True)[...] = (
        attributes["alpha"] * ffi.host_array(x, writeable=False).astype(np.float32)
        + ffi.host_array(y, writeable=False).astype(np.float32)).astype(out.dtype)


def _fail(call: ffi.Call) -> None:
    kind = call.attributes()["kind"]
    if kind == 0:
        raise ValueError("bad operand from the handler")
    if kind == 1:
        raise NotImplementedError("not here")
    if kind == 2:
        call.stream()                     # CPU calls have no stream
    raise RuntimeError("internal trouble")


_HANDLERS = [ffi.make_handler("cudnn_attn_test_axpy", _axpy), ffi.make_handler("cudnn_attn_test_fail", _fail)]
for _handler in _HANDLERS:
    ffi.register(_handler, "cpu")


def _axpy_call(x, y, alpha):
    return jax.ffi.ffi_call("cudnn_attn_test_axpy", jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, y, alpha=np.float32(alpha), tag=np.int64(7))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
def test_buffers_attributes_and_dtypes(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(-2, 2, (3, 5)), jnp.float32).astype(dtype)
    y = jnp.asarray(rng.uniform(-2, 2, (3, 5)), jnp.float32).astype(dtype)
    out = jax.jit(_axpy_call, static_argnums=2)(x, y, 0.5)
    expected = (0.5 * np.asarray(x, np.float32) + np.asarray(y, np.float32)).astype(np.dtype(x.dtype))
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert [b.shape for b in seen["args"]] == [(3, 5), (3, 5)] and seen["rets"][0].dtype == np.dtype(x.dtype)
    assert seen["attributes"] == {"alpha": 0.5, "tag": 7}


def test_arguments_are_xla_buffers_not_copies():
    x = jnp.arange(8, dtype=jnp.float32)
    y = jnp.ones(8, jnp.float32)
    jax.block_until_ready(jax.jit(_axpy_call, static_argnums=2)(x, y, 2.0))
    assert seen["addresses"] == [x.unsafe_buffer_pointer(), y.unsafe_buffer_pointer()]


def test_one_pass_frame_read_matches_the_structured_reads():
    x, y = jnp.arange(6, dtype=jnp.float32), jnp.ones(6, jnp.float32)
    call = jax.jit(lambda x, y: jax.ffi.ffi_call("cudnn_attn_test_axpy", jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, y, alpha=np.int64(41)))                      # one int64 attribute: the handler's fast path
    out = jax.block_until_ready(call(x, y))
    key, args, rets = seen["fast"]
    assert key == 41 and args == [x.unsafe_buffer_pointer(), y.unsafe_buffer_pointer()]
    assert rets == [b.address for b in seen["rets"]] and len(rets) == 1
    np.testing.assert_array_equal(np.asarray(out), 41 * np.arange(6) + 1)


def test_host_array_views_are_read_only_for_arguments():
    buffer = ffi.Buffer(np.zeros(4, np.float32).ctypes.data, (4,), np.dtype(np.float32))
    with pytest.raises(ValueError, match="read-only"):
        ffi.host_array(buffer, writeable=False)[0] = 1.0
    assert ffi.host_array(ffi.Buffer(0, (0, 3), np.dtype(np.float16)), writeable=True).shape == (0, 3)


@pytest.mark.parametrize("kind, code, message", [
    (0, "INVALID_ARGUMENT", "ValueError: bad operand from the handler"),
    (1, "UNIMPLEMENTED", "NotImplementedError: not here"),
    (2, "INTERNAL", "RuntimeError: XLA_FFI_Stream_Get failed"),
    (3, "INTERNAL", "RuntimeError: internal trouble"),
], ids=["value_error", "not_implemented", "no_stream_on_cpu", "runtime_error"])
def test_python_errors_become_xla_errors(kind, code, message):
    x = jnp.ones(4, jnp.float32)
    call = jax.jit(lambda x: jax.ffi.ffi_call("cudnn_attn_test_fail", jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, kind=np.int64(kind)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"{code}: {message}"):
        jax.block_until_ready(call(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x + 1)(x)), 2.0)   # the runtime is fine


def test_call_site_registry_is_stable_and_explains_unknown_keys():
    from cudnn_attn.core.validation import validate_call

    config, _ = validate_call(*(np.empty((1, 8, 2, 8), np.float16) for _ in range(3)), xp=np)
    registry = CallRegistry()
    first = registry.key(AttentionCall(config, "fwd"))
    assert registry.key(AttentionCall(config, "fwd")) == first
    assert registry.key(AttentionCall(config, "bwd")) != first
    assert registry.call(first) == AttentionCall(config, "fwd")
    with pytest.raises(LookupError, match="lowered in another process"):
        registry.call(first + 5)
    with pytest.raises(ValueError, match="kind"):
        AttentionCall(config, "sideways")


# -- the GPU handler's Python on a call frame in host memory (no GPU: the launch is recorded) -------------

class _RecordingPlan:
    """What the handler needs of a CallPlan: ``launch`` (recorded) and the workspace size."""

    def __init__(self, workspace_size):
        self.workspace_size, self.launches = workspace_size, []
        self.kind = "bwd"

    def launch(self, pointers, stream, workspace, scalars, keep_stream, capturable=True):
        self.launches.append((list(pointers), stream, workspace, scalars, keep_stream, capturable))

    def specialized(self, scalars=(), keep_stream=False):       # CallPlan.specialized's contract
        return lambda pointers, stream, workspace=None, capturable=True: self.launch(
            pointers, stream, workspace, scalars, keep_stream, capturable)


@pytest.mark.parametrize("n_args,n_rets,workspace_size", [(3, 2, 256), (6, 4, 0), (1, 1, 64)])
def test_gpu_handler_passes_the_frames_buffers_stream_and_workspace_to_the_site_launch(
        n_args, n_rets, workspace_size):
    from cudnn_attn.jax_bridge import cudnn_target

    key = 2 ** 40 + n_args                       # a key no lowering of this process uses
    frame = ffi.HostCallFrame(key, n_args, n_rets)
    call = ffi.Call(frame.address)
    assert call.snapshot() == ffi.Snapshot(key, [0x1000 * (i + 1) for i in range(n_args + n_rets)], 0, 0)
    assert call.addresses_and_key() == (key, call.arg_addresses(), call.ret_addresses())
    assert [b.address for b in call.args + call.rets] == call.snapshot().addresses
    plan = _RecordingPlan(workspace_size)
    cudnn_target._launches[(key, 0)] = cudnn_target._site_launch(plan, (1234, 0))
    unpin = cudnn_target.plan_holds.pin(key)           # as an executable's instantiate stage does
    try:
        handler = ffi.make_handler("cudnn_attn_test_host_frame", cudnn_target._run)
        assert ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(handler.address)(frame.address) is None
        cudnn_target.stages = []
        cudnn_target._run(call)
        [recorded] = cudnn_target.stages
        assert recorded.kind == "bwd" and min(recorded[:3]) >= 0 and recorded.total == sum(recorded[:3])
        cudnn_target._run_eager(call)               # the target XLA never records into a command buffer
    finally:
        cudnn_target.stages = None
        del cudnn_target._launches[(key, 0)]
        unpin()
    assert cudnn_target.plan_holds.releasing, "the handler saw the pin"
    addresses = [0x1000 * (i + 1) for i in range(n_args + n_rets)]
    expected = (addresses[:-1], 0, addresses[-1] if workspace_size else 0, (1234, 0), True)
    assert plan.launches == [(*expected, True), (*expected, True), (*expected, False)]


def test_gpu_handler_names_an_unplanned_device():
    from cudnn_attn.core.config import AttentionConfig
    from cudnn_attn.jax_bridge import cudnn_target
    from cudnn_attn.jax_bridge.call_site import AttentionCall, registry

    config = AttentionConfig(batch=1, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16,
                             dtype="float16", scale=0.0123)        # a configuration no GPU test lowers
    key = registry.key(AttentionCall(config, "fwd"))
    frame = ffi.HostCallFrame(key, 3, 2)
    with pytest.raises(RuntimeError, match="not planned for GPU 0"):
        cudnn_target._run(ffi.Call(frame.address))


@pytest.mark.parametrize("value", [0, 41, -5, 2 ** 63 - 1, -2 ** 63])
def test_the_single_int64_attribute_is_read_signed(value):
    frame = ffi.HostCallFrame(value, 2, 1)
    call = ffi.Call(frame.address)
    assert call.snapshot().key == value and call.addresses_and_key()[0] == value
    assert call.int64_attribute("key") == value and call.attributes() == {"key": value}


def test_a_known_device_skips_the_device_query(monkeypatch):
    """In a process with one GPU the handler passes its ordinal (``cudnn_target.only_device``): the snapshot then
    asks XLA only for the stream (the host frame's device query would answer 0)."""
    from cudnn_attn.jax_bridge import cudnn_target

    key = 2 ** 42
    frame = ffi.HostCallFrame(key, 3, 2)
    call = ffi.Call(frame.address)
    asked = call.snapshot()
    told = call.snapshot(3)
    assert (told.key, told.addresses, told.stream, told.device) == (asked.key, asked.addresses, asked.stream, 3)
    plan = _RecordingPlan(64)
    cudnn_target._launches[(key, 3)] = cudnn_target._site_launch(plan, ())
    unpin = cudnn_target.plan_holds.pin(key)
    monkeypatch.setattr(cudnn_target, "only_device", 3)
    try:
        cudnn_target._run(call)
    finally:
        del cudnn_target._launches[(key, 3)]
        unpin()
    assert len(plan.launches) == 1


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "pthread_create"), reason="needs POSIX threads")
def test_gpu_handler_from_foreign_threads_each_with_a_fresh_thread_state():
    """XLA runs the handler on its own threads, which enter Python through ctypes with a fresh thread state per
    call.  Here every call is a new POSIX thread whose start routine is the handler itself (its C signature is a
    thread's), many at once, from several Python threads: every call launches its own call site's plan with the
    frame's addresses, and none fails."""
    import threading

    from cudnn_attn.jax_bridge import cudnn_target

    keys = [2 ** 43 + i for i in range(8)]
    frames = {key: ffi.HostCallFrame(key, 3, 2) for key in keys}
    plans = {key: _RecordingPlan(64) for key in keys}
    unpins = []
    for key in keys:
        cudnn_target._launches[(key, 0)] = cudnn_target._site_launch(plans[key], ())
        unpins.append(cudnn_target.plan_holds.pin(key))
    handlers = [ffi.make_handler("cudnn_attn_test_foreign", cudnn_target._run),
                ffi.make_handler("cudnn_attn_test_foreign_eager", cudnn_target._run_eager)]
    libc = ctypes.CDLL(None)
    libc.pthread_create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    libc.pthread_join.argtypes = [ctypes.c_ulong, ctypes.POINTER(ctypes.c_void_p)]
    failures, rounds = [], 25

    def spawn():                       # CDLL releases the GIL around create and join: the handlers run meanwhile
        for _ in range(rounds):
            threads = []
            for i, key in enumerate(keys):
                thread = ctypes.c_ulong()
                assert libc.pthread_create(ctypes.byref(thread), None, handlers[i % 2].address,
                                           frames[key].address) == 0
                threads.append(thread.value)
            for thread in threads:
                error = ctypes.c_void_p()
                libc.pthread_join(thread, ctypes.byref(error))
                if error.value:                          # an XLA_FFI_Error*: the handler raised
                    failures.append(error.value)

    try:
        spawners = [threading.Thread(target=spawn) for _ in range(4)]
        for spawner in spawners:
            spawner.start()
        for spawner in spawners:
            spawner.join()
    finally:
        for key, unpin in zip(keys, unpins):
            del cudnn_target._launches[(key, 0)]
            unpin()
    assert not failures, f"{len(failures)} handler calls failed"
    addresses = [0x1000 * (i + 1) for i in range(5)]
    for i, key in enumerate(keys):
        expected = (addresses[:-1], 0, addresses[-1], (), True, i % 2 == 0)     # _run: capturable; _run_eager: not
        assert plans[key].launches == [expected] * (4 * rounds), key


# -- XLA's threads keep their Python thread state -----------------------------------------------------------

def _foreign_thread():
    """tests/_foreign_thread.py: a compiled caller that calls a function pointer from a new POSIX thread."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent / "_foreign_thread.py"
    spec = importlib.util.spec_from_file_location("foreign_thread", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module._library()
    except module.Unavailable as exc:
        pytest.skip(str(exc))
    return module


def _counting_handler(counts: list):
    """A handler recording, per execution, how many executions this thread state has seen (a threading.local
    count: 1 on every call of a state made for the call, 1, 2, 3, ... on a state that lives on)."""
    import threading

    local = threading.local()

    def count(call: ffi.Call) -> None:
        local.n = getattr(local, "n", 0) + 1
        counts.append(local.n)

    return ffi.make_handler("cudnn_attn_test_thread_state", count)


def test_foreign_thread_keeps_its_state_from_its_second_call():
    """XLA calls a handler from threads Python did not start: from the second call on, the thread's Python state
    is kept (the first call's is not: a thread calling once leaves nothing), so later calls reuse it."""
    caller, counts = _foreign_thread(), []
    handler, frame = _counting_handler(counts), ffi.HostCallFrame(1, 1, 1)
    before = ffi.thread_states()
    run = caller.call_from_new_thread(handler.address, frame.address, 10)
    assert run.nonzero == 0
    assert counts == [1] + list(range(1, 10)), counts
    assert ffi.thread_states() == (before.fresh_entries + 2, before.kept + 1)     # entries 1 and 2 were fresh

    counts.clear()
    assert caller.call_from_new_thread(handler.address, frame.address, 1).nonzero == 0
    assert counts == [1] and ffi.thread_states() == (before.fresh_entries + 3, before.kept + 1)   # one call: not kept


def test_foreign_thread_states_not_kept_when_off_or_at_the_cap(monkeypatch):
    """CUDNN_ATTN_KEEP_THREAD_STATES=0 (the module flag) and the cap: every call gets a state of its own, as
    ctypes does by itself."""
    caller, counts = _foreign_thread(), []
    handler, frame = _counting_handler(counts), ffi.HostCallFrame(1, 1, 1)
    before = ffi.thread_states()
    monkeypatch.setattr(ffi, "keep_thread_states", False)
    caller.call_from_new_thread(handler.address, frame.address, 5)
    monkeypatch.setattr(ffi, "keep_thread_states", True)
    monkeypatch.setattr(ffi, "KEPT_THREADS_MAX", before.kept)
    caller.call_from_new_thread(handler.address, frame.address, 5)
    assert counts == [1] * 10
    assert ffi.thread_states() == (before.fresh_entries + 5, before.kept)      # off: not even counted


def test_python_thread_is_marked_not_kept():
    """A thread Python started keeps its own state: the handler only marks it (no reference taken, no slot used)."""
    import threading

    counts = []
    handler = _counting_handler(counts)
    frame = ffi.HostCallFrame(1, 1, 1)
    entry = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(handler.address)
    before = ffi.thread_states()

    def calls():
        for _ in range(5):
            entry(frame.address)

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    assert counts == [1, 2, 3, 4, 5] and ffi.thread_states() == (before.fresh_entries + 1, before.kept)


def test_keep_thread_states_read_from_the_environment():
    import os
    import subprocess
    import sys

    code = "from cudnn_attn.jax_bridge import ffi; print(ffi.keep_thread_states)"
    for value, expected in (("0", "False"), ("off", "False"), ("", "True")):
        env = dict(os.environ, CUDNN_ATTN_KEEP_THREAD_STATES=value, CUDNN_ATTN_PRELOAD="0")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, (value, out.stdout, out.stderr)
