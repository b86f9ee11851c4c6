"""The direct path's kept results (:mod:`cudnn_attn.engine.result_blocks`), with stand-ins for CuPy's ``Memory`` /
``MemoryPointer`` / ``ndarray``: a call's results are handed out again only when nothing of the caller's refers
to them (array, view, pointer, memory) and their shape is unchanged, per owner and stream, within the bounds,
and never to two callers at once."""

from __future__ import annotations

import threading

import pytest

from cudnn_attn.engine.result_blocks import ResultBlocks


class Memory:
    pass


class Pointer:                      # what CuPy's arrays (and their views) hold
    def __init__(self, mem, offset=0):
        self.mem, self.offset = mem, offset


class Array:
    def __init__(self, data, shape=(4,), base=None):
        self.data, self.shape, self.base = data, shape, base

    def view(self):
        return Array(Pointer(self.data.mem, self.data.offset), self.shape, base=self)


def make(count=1):
    def new():
        memory = Memory()
        return [Array(Pointer(memory, 256 * i)) for i in range(count)]
    return new


def test_dropped_results_come_back():
    blocks = ResultBlocks()
    first = blocks.results("sig", 1, 256, make())
    address = id(first[0])
    del first
    assert id(blocks.results("sig", 1, 256, make())[0]) == address
    assert blocks.stats().reused == 1 and blocks.stats().allocated == 1


@pytest.mark.parametrize("count", [1, 3])          # one result (a forward) has a block of its own kind
@pytest.mark.parametrize("holder", ["array", "view", "pointer", "memory", "container", "last of them"])
def test_results_the_caller_still_holds_are_not_handed_out(holder, count):
    blocks = ResultBlocks()
    results = blocks.results("sig", 1, 256 * count, make(count))
    kept = {"array": results[0], "view": results[0].view(), "pointer": results[0].data,
            "memory": results[0].data.mem, "container": [results], "last of them": results[-1]}[holder]
    first = [id(a) for a in results]
    del results
    again = blocks.results("sig", 1, 256 * count, make(count))
    assert not set(map(id, again)) & set(first)
    assert blocks.stats() == (0, 2, 2, 512 * count)
    del kept                                    # the caller lets go of the first results (still holding again)
    third = blocks.results("sig", 1, 256 * count, make(count))
    assert [id(a) for a in third] == first and blocks.stats().reused == 1


@pytest.mark.parametrize("count", [1, 3])
def test_a_reshaped_result_is_not_handed_out(count):
    blocks = ResultBlocks()
    results = blocks.results("sig", 1, 256 * count, make(count))
    results[-1].shape = (2, 2)                       # cupy allows a.shape = ... in place
    first = id(results[-1])
    del results
    assert id(blocks.results("sig", 1, 256 * count, make(count))[-1]) != first


def test_a_loop_that_rebinds_its_result_alternates_two_blocks():
    """``o = f()``: the previous result is alive while the next call runs, so it cannot be handed out; two
    alternate, each at a fixed address (what the replayed launch needs)."""
    blocks = ResultBlocks()
    o, addresses = None, []
    for _ in range(8):
        o = blocks.results("sig", 1, 256, make())[0]
        addresses.append(id(o.data.mem))
    assert addresses[2:] == addresses[:2] * 3 and addresses[0] != addresses[1]
    assert blocks.stats() == (6, 2, 2, 512)


def test_blocks_are_per_owner_and_stream():
    blocks = ResultBlocks()
    blocks.results("a", 1, 256, make())
    blocks.results("a", 2, 256, make())              # "a"'s results on stream 1 are free, but not this stream's
    assert blocks.stats().allocated == 2
    blocks.results("b", 1, 256, make())
    assert blocks.stats().allocated == 3 and blocks.stats().kept == 3
    blocks.results("a", 1, 256, make())
    assert blocks.stats().reused == 1


def test_bounds():
    blocks = ResultBlocks(budget=1000, block_max=400)
    blocks.results("big", 1, 401, make())            # never kept
    assert blocks.stats() == (0, 0, 0, 0)
    for owner in "abc":
        blocks.results(owner, 1, 400, make())
    assert blocks.stats().kept == 2 and blocks.stats().kept_bytes == 800    # "a" dropped: least recent
    blocks.results("a", 1, 400, make())
    assert blocks.stats().reused == 0
    blocks.clear()
    assert blocks.stats().kept == 0 and blocks.stats().kept_bytes == 0


def test_threads_never_share_results():
    blocks = ResultBlocks()
    errors = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        for _ in range(2000):
            out = blocks.results("sig", 1, 64, make())[0]
            if getattr(out.data.mem, "owner", None) is not None:
                errors.append("shared")
            out.data.mem.owner = threading.get_ident()
            out.data.mem.owner = None

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = blocks.stats()                          # reused is counted without the lock: at most 16000 in all
    assert stats.reused > 0 and stats.allocated < 16000 and stats.reused + stats.allocated <= 16000
    assert stats.kept <= 2 and stats.kept_bytes == 64 * stats.kept


def test_a_list_put_back_after_another_thread_stored_one_is_merged_and_counted_once():
    blocks = ResultBlocks()
    first = blocks.results("k", 1, 256, make())
    in_flight = blocks._blocks.pop(("k", 1))        # a reuse in progress on another thread holds the list
    second = blocks.results("k", 1, 256, make())    # so this call makes new results and stores them
    blocks._store(("k", 1), in_flight, 256)          # the other thread puts its list back
    assert blocks.stats() == (0, 2, 2, 512)
    del first, second
    blocks.results("k", 1, 256, make())
    assert blocks.stats() == (1, 2, 2, 512)
