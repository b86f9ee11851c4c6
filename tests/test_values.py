"""The values cuDNN reads as positions (``cudnn_attn.core.values``): host checks, the device guard, the checked mode.

* :func:`check` names the argument, the row and the value for every rule of the module's table;
* :func:`sanitize` (NumPy, and ``jax.numpy`` under ``jit``: the same operations) leaves valid values
  alone and brings random bad ones - huge, negative, past the end - into ranges where every segment
  lies inside its buffer and every page id inside the cache, as the table documents;
* the reference computes for clamped values exactly what it computes for the hand-clamped ones;
* the JAX bridge: eager calls check concrete values, ``jit`` clamps, the checked mode reports the
  argument at run time (also under ``vmap``), the environment variable turns it on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_attn import MaskType, reference
from cudnn_attn import jax_bridge as jb
from cudnn_attn.core import values
from cudnn_attn.core.validation import validate_call

B, T, S, N, K, H = 2, 8, 12, 2, 1, 8
M = 3                      # packed segments per row


def _qkv(rng, t=T, s=S):
    return (rng.standard_normal((B, t, N, H)).astype(np.float16),
            rng.standard_normal((B, s, K, H)).astype(np.float16), rng.standard_normal((B, s, K, H)).astype(np.float16))


def _i32(x):
    return np.asarray(x, np.int32)


def _padded(rng, q_seqlen, kv_seqlen):
    q, k, v = _qkv(rng)
    return validate_call(q, k, v, q_seqlen=_i32(q_seqlen), kv_seqlen=_i32(kv_seqlen), mask_type=MaskType.PADDING)


def _packed(rng, q_seqlen, kv_seqlen, q_offsets, kv_offsets):
    q, k, v = _qkv(rng)
    return validate_call(q, k, v, q_seqlen=_i32(q_seqlen), kv_seqlen=_i32(kv_seqlen), q_offsets=_i32(q_offsets),
                         kv_offsets=_i32(kv_offsets))


def _paged(rng, kv_seqlen, table, blocks=5, block_size=4):
    q = rng.standard_normal((B, T, N, H)).astype(np.float16)
    cache = rng.standard_normal((blocks, block_size, K, H)).astype(np.float16)
    table = _i32(table).reshape(B, 1, -1, 1)
    return validate_call(q, cache, cache.copy(), q_seqlen=_i32([T, T]), kv_seqlen=_i32(kv_seqlen), page_table_k=table,
                         page_table_v=table.copy())


# -- the host check names the argument, the row and the value -------------------------------------------------
@pytest.mark.parametrize("build, message", [
    (lambda r: _padded(r, [3, T + 1], [2, 2]), r"q_seqlen: row 1 is 9, outside \[0, 8\] \(T = 8\)"),
    (lambda r: _padded(r, [3, 3], [-2, 2]), r"kv_seqlen: row 0 is -2, outside \[0, 12\] \(S = 12\)"),
    (lambda r: _packed(r, [[2, 3, -1], [4, -1, -1]], [[2, 3, -1], [4, -1, -1]], [[0, 2, -1, -1], [0, 5, -1, -1]],
                       [[0, 2, -1, -1], [0, -1, -1, -1]]),
     r"q_offsets: row 1 is \[0, 5, -1, -1\], but q_seqlen\[1\] = \[4, -1, -1\] has 1 segment"),
    (lambda r: _packed(r, [[2, 3, -1], [4, -1, -1]], [[2, 3, -1], [4, -1, -1]], [[0, 6, -1, -1], [0, -1, -1, -1]],
                       [[0, 2, -1, -1], [0, -1, -1, -1]]),
     r"q_offsets: row 0, segment 1: \[6, 9\).*inside the row of 8"),
    (lambda r: _packed(r, [[2, 3, -1], [4, -1, -1]], [[2, 3, -1], [4, -1, -1]], [[0, 1, -1, -1], [0, -1, -1, -1]],
                       [[0, 2, -1, -1], [0, -1, -1, -1]]), r"q_offsets: row 0, segment 1 starts at 1, before segment 0 "
                                                           r"ends at 2"),
    (lambda r: _paged(r, [8, 5], [[0, 1, 2], [3, 7, 4]]), r"page_table_k: row 1: entry \[1, 0, 1, 0\] = 7"),
], ids=["q_seqlen-past-T", "kv_seqlen-negative", "packed-pattern", "packed-past-row", "packed-overlap",
        "page-id-past-cache"])
def test_host_check_names_argument_row_and_value(build, message):
    config, operands = build(np.random.default_rng(1))
    with pytest.raises(ValueError, match=message):
        values.check(config, operands)


def test_unused_page_entries_may_hold_anything():
    config, operands = _paged(np.random.default_rng(2), [8, 4], [[0, 1, -7], [3, 99, 99]])
    values.check(config, operands)           # row 0 reads blocks 0-1, row 1 block 0 only


def test_checking_follows_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv(values.ENV_VAR, raising=False)
    assert not values.checking(None) and values.checking(True) and not values.checking(False)
    monkeypatch.setenv(values.ENV_VAR, "1")
    assert values.checking(None) and not values.checking(False)
    with pytest.raises(ValueError, match="check_values: must be True, False or None"):
        values.checking("yes")


# -- the device guard ---------------------------------------------------------------------------------------
def _safe(config, operands):
    """The invariants that keep cuDNN inside the buffers (module doc of cudnn_attn.core.values)."""
    if config.packing is not None:
        slots = config.packing.max_segments
        for side, limit in (("q", config.q_len), ("kv", config.kv_len)):
            offsets = np.asarray(getattr(operands, f"{side}_offsets"))
            lengths = np.asarray(getattr(operands, f"{side}_seqlen"))
            present = offsets[:, :slots] >= 0
            assert (offsets[:, slots] == -1).all()
            assert (np.sort(~present, axis=1, kind="stable") == ~present).all()          # present slots first
            assert (np.where(present, lengths, 0) >= 0).all()
            assert (np.where(present, offsets[:, :slots] + lengths, 0) <= limit).all()
            assert (np.where(present, 0, offsets[:, :slots] + 1) == 0).all()           # absent: -1
            assert (np.where(present, 0, lengths + 1) == 0).all()
    elif config.mask.padding:
        assert (0 <= np.asarray(operands.q_seqlen)).all() and (np.asarray(operands.q_seqlen) <= config.q_len).all()
        assert (0 <= np.asarray(operands.kv_seqlen)).all() and (np.asarray(operands.kv_seqlen) <= config.kv_len).all()
    if config.paging is not None:
        for table, blocks in ((operands.page_table_k, config.paging.num_blocks_k),
                              (operands.page_table_v, config.paging.num_blocks_v)):
            assert ((0 <= np.asarray(table)) & (np.asarray(table) < blocks)).all()


def _wild(rng, shape):
    """Random int32 values, mostly far out of range."""
    return rng.choice([-(2 ** 31), -7, -1, 0, 1, 3, 5, 11, 13, 999, 2 ** 31 - 1], size=shape).astype(np.int32)


@pytest.mark.parametrize("kind", ["padded", "packed", "paged"])
def test_sanitize_brings_random_values_into_the_buffers_with_numpy_and_under_jit(kind):
    rng = np.random.default_rng({"padded": 3, "packed": 4, "paged": 5}[kind])
    for _ in range(20):
        if kind == "padded":
            config, operands = _padded(rng, _wild(rng, B), _wild(rng, B))
        elif kind == "packed":
            config, operands = _packed(rng, _wild(rng, (B, M)), _wild(rng, (B, M)), _wild(rng, (B, M + 1)),
                                       _wild(rng, (B, M + 1)))
        else:
            config, operands = _paged(rng, _wild(rng, B), _wild(rng, (B, 3)))
        clamped = values.sanitize(config, operands, np)
        _safe(config, clamped)
        fields = values.present(operands)
        traced = jax.jit(lambda arrays: values.present(values.sanitize(config, operands.replace(**arrays), jnp)))(
            {n: jnp.asarray(x) for n, x in fields.items()})
        for name, x in traced.items():
            np.testing.assert_array_equal(np.asarray(x), getattr(clamped, name), err_msg=name)
            assert x.dtype == np.int32 and getattr(clamped, name).dtype == np.int32, name


def test_sanitize_keeps_valid_values_and_the_reference_agrees_with_hand_clamping():
    rng = np.random.default_rng(6)
    config, good = _padded(rng, [5, 8], [12, 3])
    assert all((np.asarray(getattr(values.sanitize(config, good, np), n)) == getattr(good, n)).all()
               for n in ("q_seqlen", "kv_seqlen"))
    config, bad = _padded(rng, [5, 99], [-4, 30])
    clamped = values.sanitize(config, bad, np)
    np.testing.assert_array_equal(clamped.q_seqlen, [5, 8])
    np.testing.assert_array_equal(clamped.kv_seqlen, [0, 12])
    by_hand = bad.replace(q_seqlen=_i32([5, 8]), kv_seqlen=_i32([0, 12]))
    np.testing.assert_array_equal(reference.forward(config, clamped).output, reference.forward(config, by_hand).output)


def test_sanitized_packed_rows_move_present_segments_first_and_cut_them_at_the_row():
    rng = np.random.default_rng(7)
    config, operands = _packed(rng, [[-1, 3, 4], [9, -1, -1]], [[2, 2, 30], [4, -1, -1]],
                               [[-1, 0, 5, 7], [2, -1, -1, -1]], [[0, 0, 6, 2], [1, -1, -1, -1]])
    clamped = values.sanitize(config, operands, np)
    np.testing.assert_array_equal(clamped.q_offsets, [[0, 5, -1, -1], [2, -1, -1, -1]])
    np.testing.assert_array_equal(clamped.q_seqlen, [[3, 3, -1], [6, -1, -1]])      # 5 + 4 > 8: cut to 3
    np.testing.assert_array_equal(clamped.kv_offsets, [[0, 6, -1, -1], [1, -1, -1, -1]])
    np.testing.assert_array_equal(clamped.kv_seqlen, [[2, 6, -1], [4, -1, -1]])      # 6 + 30 > 12: cut to 6
    values.check(config, clamped)                          # in order, inside the rows: the reference runs it
    reference.forward(config, clamped)


# -- the JAX bridge ---------------------------------------------------------------------------------------------
def _padded_call(q, k, v, q_seqlen, kv_seqlen, **kw):
    return jb.dot_product_attention(q, k, v, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, mask_type=MaskType.PADDING,
                                    **kw)


def test_jit_clamps_and_checked_mode_names_the_argument_under_vmap():
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(x) for x in _qkv(rng))
    bad = _i32([[3, 4], [5, 6]]), _i32([[12, 99], [1, 2]])          # vmapped over a leading axis of 2
    qs, ks, vs = (jnp.stack([x, x]) for x in (q, k, v))
    clamped = jax.jit(jax.vmap(_padded_call))(qs, ks, vs, *map(jnp.asarray, bad))
    want = reference.dot_product_attention(*(np.asarray(x) for x in (q, k, v)), q_seqlen=bad[0][0],
                                           kv_seqlen=_i32([12, 12]), mask_type=MaskType.PADDING)
    np.testing.assert_array_equal(np.asarray(clamped[0]), want)
    checked = jax.jit(jax.vmap(lambda *a: _padded_call(*a, check_values=True)))
    with pytest.raises(Exception, match=r"kv_seqlen: row 1 is 99, outside \[0, 12\]"):
        jax.block_until_ready(checked(qs, ks, vs, *map(jnp.asarray, bad)))


def test_the_environment_variable_turns_the_checked_mode_on(monkeypatch):
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(x) for x in _qkv(rng))
    monkeypatch.setenv(values.ENV_VAR, "1")
    with pytest.raises(Exception, match=r"q_seqlen: row 0 is -3"):
        jax.block_until_ready(jax.jit(_padded_call)(q, k, v, jnp.asarray(_i32([-3, 2])), jnp.asarray(_i32([4, 4]))))


def test_eager_jax_checks_concrete_values_like_the_reference():
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng)
    lengths = dict(q_seqlen=_i32([3, 3]), kv_seqlen=_i32([13, 2]), mask_type=MaskType.PADDING)
    with pytest.raises(ValueError) as ours:
        jb.dot_product_attention(*(jnp.asarray(x) for x in (q, k, v)), **{n: jnp.asarray(x) if n != "mask_type" else x
                                                                          for n, x in lengths.items()})
    with pytest.raises(ValueError) as theirs:
        reference.dot_product_attention(q, k, v, **lengths)
    assert str(ours.value) == str(theirs.value)
