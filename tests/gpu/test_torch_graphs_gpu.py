"""The torch front inside torch's CUDA graphs: ``torch.cuda.graph`` capture and replay with new inputs on every
path (the direct launch, a keep-mask, lengths, GQA, dropout, forward and backward), the first call of a signature
during capture refused, ``torch.compile(mode="reduce-overhead")`` of a decode step and of a training step with no
CUDA-graph skip, and 16 threads sharing the front and one model.

Every replay's results are compared with the float32 math SDPA of that replay's inputs (relative Frobenius error
within the GPU tier's bounds, ``_checks.RELATIVE_TOLERANCE``), after other calls have churned torch's allocator
between capture and replay and its free memory has been filled with NaN: a captured graph that read memory it
does not own, or a host value bound at capture, fails the comparison.
"""

from __future__ import annotations

import faulthandler
import threading

import pytest

from ._checks import assert_close

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

import cudnn_attn.torch as ct
from cudnn_attn.torch import ops

from .test_torch_gpu import _host, _math_sdpa, _poison_pool, _random

WATCHDOG_S = 600


def _capture(fn):
    """``fn`` warmed up twice on a side stream, then captured: ``(graph, its outputs)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def _churn(rng):
    """Eager calls of other signatures between capture and replay (they allocate and free torch memory)."""
    for length in (96, 160):
        q, k, v = (_random(rng, (2, 8, length, 64), torch.float16) for _ in range(3))
        ct.sdpa(q, k, v, causal=True, layout="BNTH")


def _left_padded_keep(B, S, rng):
    pads = torch.from_numpy(rng.integers(0, S // 2, size=B)).to("cuda")
    return (torch.arange(S, device="cuda")[None, :] >= pads[:, None]).view(B, 1, 1, S)


CASES = {
    # name: (dtype, q shape, kv shape, layout, keyword arguments of sdpa besides the tensors)
    "decode, dense, GQA (direct)": (torch.bfloat16, (4, 16, 1, 64), (4, 4, 512, 64), "BNTH", {}),
    "decode, keep-mask, bf16 (direct)": (torch.bfloat16, (4, 16, 1, 64), (4, 4, 512, 64), "BNTH", {"keep": True}),
    "decode, keep-mask, fp16 (general)": (torch.float16, (4, 16, 1, 64), (4, 4, 512, 64), "BNTH", {"keep": True}),
    "prefill, causal (direct)": (torch.float16, (2, 128, 16, 64), (2, 128, 4, 64), "BTNH", {"causal": True}),
    "prefill, lengths (general)": (torch.bfloat16, (2, 128, 8, 64), (2, 192, 8, 64), "BTNH", {"lengths": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_captured_and_replayed_with_new_inputs(rng, case):
    dtype, q_shape, kv_shape, layout, options = CASES[case]
    q, k, v = _random(rng, q_shape, dtype), _random(rng, kv_shape, dtype), _random(rng, kv_shape, dtype)
    B = q_shape[0]
    S = kv_shape[2] if layout == "BNTH" else kv_shape[1]
    T = q_shape[2] if layout == "BNTH" else q_shape[1]
    keep = _left_padded_keep(B, S, rng) if options.get("keep") else None
    q_lengths = kv_lengths = None
    if options.get("lengths"):
        q_lengths = torch.tensor([T, T // 2 + 1], dtype=torch.int32, device="cuda")
        kv_lengths = torch.tensor([S - 7, S // 3], dtype=torch.int32, device="cuda")
    causal = bool(options.get("causal"))

    def call():
        return ct.sdpa(q, k, v, causal=causal, keep=keep, q_lengths=q_lengths, kv_lengths=kv_lengths,
                       layout=layout)[0]

    graph, out = _capture(call)
    for round_ in range(3):
        for x in (q, k, v):
            x.copy_(_random(rng, x.shape, dtype))
        if keep is not None:
            keep.copy_(_left_padded_keep(B, S, rng))
        _churn(rng)
        _poison_pool()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = _reference(q, k, v, keep, causal, layout, q_lengths, kv_lengths)
        name = "bfloat16" if dtype == torch.bfloat16 else "float16"
        assert_close(f"{case}: replay {round_}", _host(out), want, name)


def _reference(q, k, v, keep, causal, layout, q_lengths, kv_lengths):
    if q_lengths is None:
        return _host(_math_sdpa(q, k, v, keep, is_causal=causal, layout=layout))
    B, T, S = q.shape[0], q.shape[1], k.shape[1]                     # BTNH
    rows = torch.arange(T, device="cuda")[None, :, None] < q_lengths[:, None, None]
    cols = torch.arange(S, device="cuda")[None, None, :] < kv_lengths[:, None, None]
    mask = (rows & cols).view(B, 1, T, S) | ~rows.view(B, 1, T, 1)  # padded rows: any finite value, zeroed below
    return _host(_math_sdpa(q, k, v, mask, layout=layout, q_lengths=q_lengths))


@pytest.mark.parametrize("lengths", [False, True], ids=["direct", "general (lengths)"])
def test_backward_captured_and_replayed_with_new_inputs(rng, lengths):
    """The forward (training) and the backward operator captured together; each replay's dq, dk, dv against the
    math SDPA's gradients of that replay's inputs."""
    B, T, N, K, H = 2, 128, 8, 4, 64
    q = _random(rng, (B, T, N, H), torch.bfloat16)
    k, v = (_random(rng, (B, T, K, H), torch.bfloat16) for _ in range(2))
    grad = _random(rng, q.shape, torch.bfloat16)
    q_lengths = torch.tensor([T, 77], dtype=torch.int32, device="cuda") if lengths else None
    static = (H ** -0.5, True, False, 0, 0.0, 0, "BTNH")

    def step():
        out, lse = torch.ops.cudnn_attn.attention(q, k, v, q_lengths, q_lengths, None, *static, True)
        return torch.ops.cudnn_attn.attention_backward(q, k, v, out, grad, lse, q_lengths, q_lengths, None, *static)

    graph, grads = _capture(step)
    for round_ in range(2):
        for x in (q, k, v, grad):
            x.copy_(_random(rng, x.shape, torch.bfloat16))
        _churn(rng)
        _poison_pool()
        graph.replay()
        torch.cuda.synchronize()
        inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        if lengths:
            rows = (torch.arange(T, device="cuda")[None, :] < q_lengths[:, None]).view(B, 1, T, 1)
            keys = (torch.arange(T, device="cuda")[None, :] < q_lengths[:, None]).view(B, 1, 1, T)
            mask = (torch.ones(T, T, dtype=torch.bool, device="cuda").tril() & keys) | ~rows
            ref = _math_sdpa(*inputs, mask, q_lengths=q_lengths)
        else:
            ref = _math_sdpa(*inputs, is_causal=True)
        want = torch.autograd.grad(ref, inputs, grad.float())
        for name, got, w in zip(("dq", "dk", "dv"), grads, want):
            assert_close(f"{name}, replay {round_}", _host(got), _host(w), "bfloat16")


def test_dropout_replays_the_mask_of_its_capture(rng):
    """The seed is a host scalar bound at capture: replays with the same inputs give the captured call's output,
    equal to an eager call with that seed."""
    q, k, v = (_random(rng, (2, 8, 128, 64), torch.bfloat16) for _ in range(3))
    graph, out = _capture(lambda: ct.sdpa(q, k, v, dropout_rate=0.2, seed=5, layout="BNTH", training=False)[0])
    graph.replay()
    first = out.clone()
    graph.replay()
    eager = ct.sdpa(q, k, v, dropout_rate=0.2, seed=5, layout="BNTH", training=False)[0]
    assert torch.equal(first, out) and torch.equal(first, eager)


def test_first_call_during_capture_asks_for_a_warm_up(rng):
    q, k, v = (_random(rng, (3, 8, 1, 64), torch.bfloat16) for _ in range(3))
    k, v = (_random(rng, (3, 8, 333, 64), torch.bfloat16) for _ in range(2))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ct.CaptureWarmupError, match="warm-up"):
        with torch.cuda.graph(graph):
            ct.sdpa(q, k, v, layout="BNTH")
    out = ct.sdpa(q, k, v, layout="BNTH")[0]                   # the front works on afterwards
    assert_close("after a refused capture", _host(out), _host(_math_sdpa(q, k, v, layout="BNTH")), "bfloat16")


def _cudagraph_skips() -> int:
    """How many compiled graphs inductor ran without CUDA graphs since ``counters.clear()``."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def test_reduce_overhead_decode_step_runs_as_a_cuda_graph(rng):
    """``torch.compile(mode="reduce-overhead")`` of a decode step with a keep-mask: no CUDA-graph skip, and every
    call with new values equals the reference."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    weight = _random(rng, (1024, 1024), torch.bfloat16) * 0.03

    def step(x, k, v, keep):
        q = (x @ weight).view(4, 1, 16, 64).transpose(1, 2)
        out = ct.sdpa(q, k, v, keep=keep, layout="BNTH")[0]
        return out.transpose(1, 2).reshape(4, 1, 1024)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    k, v = (_random(rng, (4, 4, 512, 64), torch.bfloat16) for _ in range(2))
    for i in range(5):
        x = _random(rng, (4, 1, 1024), torch.bfloat16)
        keep = _left_padded_keep(4, 512, rng)
        with torch.no_grad():
            got = compiled(x, k, v, keep).clone()
            q = (x @ weight).view(4, 1, 16, 64).transpose(1, 2)
            want = _math_sdpa(q, k, v, keep, layout="BNTH").transpose(1, 2).reshape(4, 1, 1024)
        assert_close(f"compiled decode step {i}", _host(got), _host(want), "bfloat16")
    assert _cudagraph_skips() == 0, dict(counters["inductor"])


def test_reduce_overhead_training_step_runs_as_a_cuda_graph(rng):
    """A compiled (``mode="reduce-overhead"``) attention block's forward and backward: no CUDA-graph skip, and its
    gradients equal the eager block's with torch's SDPA."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self, ours: bool):
            super().__init__()
            self.qkv, self.ours = torch.nn.Linear(512, 3 * 512, dtype=torch.bfloat16, device="cuda"), ours

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 256, 3, 8, 64).unbind(2)
            if self.ours:
                out = ct.sdpa(q, k, v, causal=True)[0]
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
            return out.float().square().mean()

    ours, theirs = Block(True), Block(False)
    theirs.load_state_dict(ours.state_dict())
    compiled = torch.compile(ours, mode="reduce-overhead")
    for i in range(4):
        x = _random(rng, (2, 256, 512), torch.bfloat16)
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)
        compiled(x).backward()
        theirs(x).backward()
        assert_close(f"step {i}: dW", _host(ours.qkv.weight.grad), _host(theirs.qkv.weight.grad), "bfloat16",
                     scale=4.0)
    assert _cudagraph_skips() == 0, dict(counters["inductor"])


def test_sixteen_threads_share_the_front_and_one_model(rng):
    """16 threads, half on streams of their own, 200 calls each of one attention block across four signatures
    (the direct launch and the general path): 0 errors, 0 results different from the single-threaded ones."""
    torch.manual_seed(0)
    projection = torch.nn.Linear(512, 512, dtype=torch.float16, device="cuda")
    shapes = [(2, 64), (2, 96), (1, 130), (3, 33)]

    def model(x, lengths):
        q = projection(x).view(x.shape[0], x.shape[1], 8, 64)
        return ct.sdpa(q, q, q, causal=True, q_lengths=lengths, kv_lengths=lengths)[0]

    inputs = []
    for i, (B, T) in enumerate(shapes):
        x = _random(rng, (B, T, 512), torch.float16)
        lengths = torch.full((B,), T - 3, dtype=torch.int32, device="cuda") if i % 2 else None
        inputs.append((x, lengths))
    with torch.no_grad():
        expected = [model(x, lengths).clone() for x, lengths in inputs]
    torch.cuda.synchronize()
    errors, mismatches = [], []

    def work(index: int) -> None:
        stream = torch.cuda.Stream() if index % 2 else torch.cuda.current_stream()
        try:
            with torch.no_grad(), torch.cuda.stream(stream):
                for call in range(200):
                    which = (index + call) % len(inputs)
                    got = model(*inputs[which])
                    if call % 20 == 0 or call == 199:
                        stream.synchronize()
                        if not torch.equal(got, expected[which]):
                            mismatches.append((index, call, which))
                stream.synchronize()
        except Exception as exc:                                    # noqa: BLE001 - counted and reported
            errors.append(f"thread {index}: {type(exc).__name__}: {exc}")

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not errors, errors[:3]
    assert not mismatches, f"{len(mismatches)} mismatches, first {mismatches[:3]}"


def test_the_raw_current_stream_query_agrees_with_the_public_one():
    """``ops._current_stream_of`` reads ``torch._C._cuda_getCurrentRawStream`` (a private query, DESIGN's table): it
    must exist and give the public ``torch.cuda.current_stream`` on the default stream and inside
    ``torch.cuda.stream``."""
    assert hasattr(torch._C, "_cuda_getCurrentRawStream"), "torch dropped _cuda_getCurrentRawStream"
    device = torch.device("cuda", torch.cuda.current_device())
    assert ops._current_stream_of(device.index) == torch.cuda.current_stream(device).cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert ops._current_stream_of(device.index) == side.cuda_stream != 0


def test_a_device_seed_draws_a_new_mask_at_every_replay(rng):
    """``seed`` as an int64 CUDA tensor ``[seed, offset]``: equal values draw equal masks (forward and backward),
    new values a new mask; drawn by torch's RNG inside a captured graph, every replay draws a new one, and each
    replay equals an eager call with that replay's seed values."""
    q, k, v = (_random(rng, (2, 8, 128, 64), torch.bfloat16) for _ in range(3))
    seed = torch.tensor([11, 0], dtype=torch.int64, device="cuda")
    first = ct.sdpa(q, k, v, dropout_rate=0.2, seed=seed, layout="BNTH", training=False)[0]
    again = ct.sdpa(q, k, v, dropout_rate=0.2, seed=seed.clone(), layout="BNTH", training=False)[0]
    other = ct.sdpa(q, k, v, dropout_rate=0.2, seed=seed + 1, layout="BNTH", training=False)[0]
    assert torch.equal(first, again) and not torch.equal(first, other)
    grads = []
    for _ in range(2):
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = ct.sdpa(*x, dropout_rate=0.2, seed=seed, layout="BNTH")[0]
        grads.append(torch.autograd.grad(out.float().square().sum(), x))
    assert all(torch.equal(a, b) for a, b in zip(*grads))

    def step():
        seed.copy_(torch.randint(0, 2 ** 62, (2,), device="cuda"))
        return ct.sdpa(q, k, v, dropout_rate=0.2, seed=seed, layout="BNTH", training=False)[0]

    graph, out = _capture(step)
    seen = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        eager = ct.sdpa(q, k, v, dropout_rate=0.2, seed=seed.clone(), layout="BNTH", training=False)[0]
        assert torch.equal(out, eager)
        seen.append(out.clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
