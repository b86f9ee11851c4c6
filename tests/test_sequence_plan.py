"""The static plans of context-parallel attention (``jax_bridge.sequence_plan``) against brute force:
the calls of every device at every step cover exactly the masked (query, key) pairs, once each, within
cuDNN's band limits; masked-out blocks make no call; load-balanced causal work is equal per device."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cudnn_attn.jax_bridge.sequence_plan import Band, chunk_order, device_plans, local_chunks


def positions(chunks, length):
    """Global position of every local position."""
    found = np.full(length, -1)
    for c in chunks:
        found[c.local:c.local + c.length] = np.arange(c.start, c.start + c.length)
    assert (found >= 0).all()
    return found


def covered(queries, keys, calls, q_len, k_len, contiguous):
    """(q_len, k_len) count of the calls that compute each local (query, key) pair, in global positions."""
    qpos, kpos = positions(queries, q_len), positions(keys, k_len)
    count = np.zeros((q_len, k_len), int)
    for c in calls:
        assert c.right_bound is None or c.right_bound >= 0, c
        assert c.left_bound is None or c.left_bound >= 1, c
        assert c.q_len > 0 and c.k_len > 0, c
        i = np.arange(c.q_len)[:, None]
        j = np.arange(c.k_len)[None, :]
        keep = np.ones((c.q_len, c.k_len), bool)
        if c.right_bound is not None:
            keep &= j - i <= c.right_bound
        if c.left_bound is not None:
            keep &= i - j < c.left_bound
        if c.padded:
            assert c.left_bound is not None and c.q_len > c.k_len
        count[c.q_start:c.q_stop, c.k_start:c.k_stop] += keep
        if contiguous:                     # the call's global positions are those of its rows and keys
            assert (qpos[c.q_start:c.q_stop] == c.q_global + np.arange(c.q_len)).all()
            assert (kpos[c.k_start:c.k_stop] == c.k_global + np.arange(c.k_len)).all()
    return count, qpos, kpos


CASES = [(band, shards, balance, length)
         for band in [Band(), Band(hi=0), Band(lo=-5, hi=0), Band(lo=-13, hi=0), Band(lo=-3, hi=4), Band(hi=9)]
         for shards, balance in [(1, 0), (2, 0), (4, 0), (2, 2), (4, 4), (8, 8), (2, 4), (1, 4)]
         for length in [32, 64]]


@pytest.mark.parametrize("band, shards, balance, length", CASES)
@pytest.mark.parametrize("scheme", ["ring", "all_gather"])
def test_plans_cover_exactly_the_mask(band, shards, balance, length, scheme):
    if balance and length % (2 * balance):
        pytest.skip("length not a multiple of 2Z")
    i = np.arange(length)[:, None]
    j = np.arange(length)[None, :]
    full = np.ones((length, length), bool)
    if band.hi is not None:
        full &= j - i <= band.hi
    if band.lo is not None:
        full &= j - i > band.lo
    local = length // shards
    queries = [local_chunks(length, shards, r, balance) for r in range(shards)]
    total = np.zeros((length, length), int)
    steps = range(shards) if scheme == "ring" else [None]
    for contiguous_only, step in itertools.product([False, True], steps):
        if scheme == "ring":
            keys = [local_chunks(length, shards, (r - step) % shards, balance) for r in range(shards)]
            key_len = local
        else:
            keys = [local_chunks(length, 1, 0) for _ in range(shards)]
            key_len = length
        step_plans = device_plans(queries, keys, band, contiguous_only=contiguous_only)
        for r in range(shards):
            assert step_plans.plans[step_plans.index[r]] == step_plans.calls[r]
            count, qpos, kpos = covered(queries[r], keys[r], step_plans.calls[r], local, key_len, contiguous_only)
            if contiguous_only:
                total[np.ix_(qpos, kpos)] += count
            else:
                np.testing.assert_array_equal(count, full[np.ix_(qpos, kpos)].astype(int), err_msg=f"r={r} s={step}")
    np.testing.assert_array_equal(total, full.astype(int))


def test_masked_blocks_make_no_call_and_load_balance_evens_the_causal_work():
    length, shards = 64, 4
    natural = [local_chunks(length, shards, r) for r in range(shards)]
    balanced = [local_chunks(length, shards, r, shards) for r in range(shards)]
    work = {"natural": np.zeros(shards, int), "balanced": np.zeros(shards, int)}
    for step in range(shards):
        for name, layout in (("natural", natural), ("balanced", balanced)):
            keys = [layout[(r - step) % shards] for r in range(shards)]
            step_plans = device_plans(layout, keys, Band(hi=0), contiguous_only=False)
            assert len(step_plans.plans) <= 2                    # one of two calls, or nothing
            for r in range(shards):
                calls = step_plans.calls[r]
                if name == "natural" and (r - step) % shards > r:
                    assert calls == (), (r, step, calls)          # a later key block: skipped
                assert len(calls) <= 1, calls                     # one merged call per step
                work[name][r] += sum(c.q_len * c.k_len for c in calls)
    assert len(set(work["balanced"])) == 1, work
    assert work["natural"].max() == 4 * work["natural"].min(), work


def test_chunk_order_is_the_zigzag():
    assert chunk_order(2) == (0, 3, 1, 2)
    assert [(c.start, c.length) for c in local_chunks(16, 2, 0, 2)] == [(0, 4), (12, 4)]
    assert [(c.start, c.length) for c in local_chunks(16, 2, 1, 2)] == [(4, 8)]       # chunks 1, 2 adjoin
