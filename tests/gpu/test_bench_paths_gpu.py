"""The calls the benchmarks time compute the right thing: the raw launch ``bench_small`` times as the kernel
floor, every library variant of the growing-cache decode (``decode_growing``), and the minimal transformers
attention function of ``bench_generate``, each against the NumPy reference (tolerances: ``_checks``)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ._checks import assert_close

pytestmark = pytest.mark.gpu

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def _host(x) -> np.ndarray:
    import cupy as cp

    return cp.asnumpy(cp.from_dlpack(x)).astype(np.float32)


def test_raw_launch_of_the_small_shape_matches_the_reference():
    import cupy as cp

    import cudnn_attn
    from cudnn_attn import reference
    from cudnn_attn.core.validation import validate_call
    from cudnn_attn.engine.call import OPERAND_IDS

    bench_host = _bench("bench_host")
    rng = np.random.default_rng(11)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    host = [rng.standard_normal((1, 256, 8, 64), dtype=np.float32).astype(bf16) for _ in range(3)]
    q, k, v = (cp.asarray(x) for x in host)
    config, _ = validate_call(q, k, v, scale=0.125, xp=cp)
    plan = cudnn_attn.graph_cache.plan(config, "fwd", q.device.id)
    by_id = {OPERAND_IDS["query"]: q, OPERAND_IDS["key"]: k, OPERAND_IDS["value"]: v}
    results = [cp.full(spec.shape, np.nan, spec.dtype) for spec in plan.results]
    stream = cp.cuda.get_current_stream().ptr
    raw = bench_host.raw_launch(plan, [by_id[t].data.ptr for t in plan.operand_ids] + [r.data.ptr for r in results],
                                stream)
    if raw is None:
        pytest.skip("the cuDNN frontend has no raw launch entry point")
    raw()
    cp.cuda.runtime.deviceSynchronize()
    want = reference.dot_product_attention(*host, scale=0.125)
    assert_close("raw launch output (reproduce: B1 T=S=256 N8 D64 bf16 scale 0.125, bench_host.raw_launch)",
                 results[0], want, "bfloat16")


@pytest.mark.parametrize("variant", ["ours causal-br", "ours causal-br, slice", "ours causal-br, torch in",
                                     "ours keep-mask", "ours segments", "ours padding, fixed S",
                                     "ours repeated signature", "ours repeated signature, torch in"])
def test_growing_cache_decode_variant_matches_the_reference(variant):
    from cudnn_attn import keep, reference

    if "torch" in variant:
        pytest.importorskip("torch")

    growing = _bench("decode_growing")
    steps = growing.Steps(3)
    call = growing.calls(variant, steps)
    for i in range(steps.steps):
        got = call(i)
        j = 0 if "repeated" in variant else i
        q, k, v = (_host(x).astype(growing.BF16) for x in (steps.q[i], steps.k[j], steps.v[j]))
        if variant in growing.MASKED:
            mask = _host(steps.keep[i]).astype(bool)
            want = reference.attention(q, k, v, mask=keep(mask), scale=growing.SCALE).output
        else:
            want = reference.dot_product_attention(q, k, v, scale=growing.SCALE)
        assert_close(f"{variant} at S={steps.lengths[j]} (reproduce: decode_growing.calls({variant!r}, "
                     f"Steps(3))({i}))", _host(got), want, "bfloat16")


@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_generate_attention_function_matches_the_reference(segmented, masked):
    torch = pytest.importorskip("torch")
    from cudnn_attn import keep, reference

    generate = _bench("bench_generate")
    B, N, K, S, D = 4, 16, 4, 133, 64
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn((B, N, 1, D), device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn((B, K, S, D), device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    mask = None
    if masked:                                   # left padding 0, 3, 7, 11, as a prompt of generate() has
        pads = torch.tensor(generate.PADS, device="cuda")
        mask = (torch.arange(S, device="cuda")[None, :] >= pads[:, None]).reshape(B, 1, 1, S)
    out, weights = generate.ours(segmented)(None, q, k, v, mask, scaling=D ** -0.5)
    assert weights is None and tuple(out.shape) == (B, 1, N, D)
    bf16 = np.dtype(ml_dtypes.bfloat16)                   # the same bf16 values, BTNH, on the host
    hq, hk, hv = (np.ascontiguousarray(x.float().cpu().numpy().transpose(0, 2, 1, 3)).astype(bf16) for x in (q, k, v))
    if mask is None:
        want = reference.dot_product_attention(hq, hk, hv, scale=D ** -0.5)
    else:
        want = reference.attention(hq, hk, hv, mask=keep(mask.cpu().numpy()), scale=D ** -0.5).output
    assert_close(f"generate attention (reproduce: bench_generate.ours({segmented})(None, q, k, v, "
                 f"{'left-padding mask' if masked else 'None'}), B4 N16/K4 S{S} D64)",
                 out.float().cpu().numpy(), want, "bfloat16")
