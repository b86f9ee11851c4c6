"""FP8 attention (``use_fp8=True``) on the GPU against the reference's FP8 emulation and exact float64.

FP8 operands cross the public API as uint8 CuPy arrays holding the FP8 bytes (CuPy has no float8
dtype); ``fp8_dtype`` names their format.  Results written into buffers pre-filled with NaN bytes
(0xFF is NaN in both E4M3 and E5M2) prove that cuDNN wrote every element.

What cuDNN 9.19 computes, read from the frontend's ``sdpa_fp8_backward`` expansion and from the sm90
kernel templates in ``libcudnn_engines_runtime_compiled``, and how the emulation
(:mod:`cudnn_attn.reference.fp8`) matches it:

* ``amax_s`` is the maximum over query rows of ``1 / sum_j exp(s_ij - max_j s_ij)``, which is the
  maximum of the normalised probabilities P: the emulation's ``max P``;
* ``amax_o`` is ``max |O|`` before ``scale_o``; ``amax_dQ/dK/dV`` the gradients' maxima before their
  scales; ``amax_dP`` is ``max |scale * P * (dP - D)|``, the dS that ``scale_dP`` quantises;
* the forward kernel rounds the *unnormalised* ``exp(s - max)`` to FP8 and normalises at the end; the
  emulation rounds the normalised P.  Different rounding points, same precision: a flash-style
  emulation of the kernel (measured on the CPU) lands at 3.1-3.5 % relative error against float64
  for E4M3, the emulation at 3.6-3.8 %.

Tolerances.  Tensors: FlashAttention's rule, relative Frobenius error against exact float64 on the
dequantised inputs at most twice the emulation's own error plus a 1 % margin (the emulation's error is
3.6-3.8 % for E4M3 and 7.1-7.5 % for E5M2 at these shapes: FP8 keeps 3 or 2 mantissa bits, a
relative rounding of ``u = 2^-4`` or ``2^-3``).  The amax values have bounds derived from that
rounding (see :func:`assert_amax_s` and :func:`assert_amax_o`); the backward's amax values are
computed by cuDNN exactly where the emulation computes them, from the same quantised operands, so
they agree within one FP8 rounding step ``u``.  Scales are powers of two, so a scale applied in the
wrong place is an error of a factor 2 or more.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, UnsupportedConfigurationError, reference
from cudnn_attn.core.types import FP8_PARAM_KEYS
from cudnn_attn.engine.cache import graph_cache
from cudnn_attn.engine import prepared
from cudnn_attn.reference.inputs import fp8_scale, random_operands
from cudnn_attn.reference.problem import load, scores, softmax
from cudnn_attn.reference.tensors import cast

from ._checks import assert_lse_close, make_config

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

ROUNDING = {"float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}   # half an ulp, relative
MARGIN = 0.01
NAN_BYTE = 0xFF
BASE = dict(B=2, N=4, T=256, S=256, H=128)

FORWARD = {
    "e4m3-d128-causal": dict(mask_type=MaskType.CAUSAL),
    "e4m3-d128-BNTH": dict(layout="BNTH"),
    "e4m3-d64-causal-BNTH": dict(H=64, mask_type=MaskType.CAUSAL, layout="BNTH"),
    "e4m3-d256": dict(H=256),
    "e4m3-gqa-8:2-causal": dict(N=8, K=2, mask_type=MaskType.CAUSAL),
    "e4m3-T128-S384": dict(T=128, S=384),
    "e5m2-d128-causal": dict(dtype="float8_e5m2", mask_type=MaskType.CAUSAL),
    "e5m2-d64": dict(dtype="float8_e5m2", H=64),
}
BACKWARD = {        # the sm90 FP8 backward takes head dim 128 only
    "e4m3-causal": dict(mask_type=MaskType.CAUSAL),
    "e4m3-BNTH": dict(layout="BNTH"),
    "e4m3-gqa-8:2-causal": dict(N=8, K=2, mask_type=MaskType.CAUSAL),
    "e5m2-causal": dict(dtype="float8_e5m2", mask_type=MaskType.CAUSAL),
}
GRADIENTS = (("dq", "dQ", "q_shape"), ("dk", "dK", "k_shape"), ("dv", "dV", "v_shape"))   # result, scale, shape


# -- helpers -------------------------------------------------------------------------------------------
def fp8_config(case: dict, *, training: bool):
    """The AttentionConfig of an FP8 call of ``BASE`` updated by ``case`` (default E4M3, no mask)."""
    shape = {**BASE, **case}
    shape.setdefault("dtype", "float8_e4m3fn")
    shape["scale"] = 1 / math.sqrt(shape["H"])
    params = {key: np.ones((1, 1, 1, 1), np.float32) for key in FP8_PARAM_KEYS}
    return make_config(use_fp8=True, fp8_params=params, training=training, **shape)


def public_kwargs(config, operands) -> dict:
    """The keyword arguments of a public FP8 call of ``config`` with the scales of ``operands``."""
    return dict(fp8_params={k: cp.asarray(v) for k, v in operands.fp8_scales.items()}, use_fp8=True,
                scale=config.scale, mask_type=MaskType.CAUSAL if config.mask.causal else MaskType.NO_MASK,
                qkv_layout=config.layout.name, fp8_dtype=config.dtype)


def device_bytes(x: np.ndarray):
    """An FP8 NumPy array as the uint8 CuPy array of its bytes."""
    return cp.asarray(np.ascontiguousarray(x).view(np.uint8))


def host_fp8(x, dtype: str) -> np.ndarray:
    """A uint8 CuPy array of FP8 bytes as an FP8 NumPy array."""
    return cp.asnumpy(x).view(np.dtype(dtype))


def device_operands(operands):
    return operands.replace(query=device_bytes(operands.query), key=device_bytes(operands.key),
                            value=device_bytes(operands.value),
                            fp8_scales={k: cp.asarray(v) for k, v in operands.fp8_scales.items()})


def poisoned_bytes(shape):
    return cp.full(shape, NAN_BYTE, cp.uint8)


def value(x) -> float:
    return float(np.asarray(x, np.float64).reshape(()))


def scales_of(operands) -> dict[str, float]:
    return {name: value(x) for name, x in operands.fp8_scales.items()}


def dequantised(x, dtype: str, descale: float) -> np.ndarray:
    """The real values of FP8 data (NumPy FP8 array or uint8 CuPy bytes): stored value times descale."""
    if isinstance(x, cp.ndarray):
        x = host_fp8(x, dtype)
    values = x.astype(np.float64)
    assert not np.isnan(values).any(), f"{int(np.isnan(values).sum())} of {values.size} FP8 elements are NaN"
    return values * descale


def exact_problem(config, operands):
    """float64 config and operands holding the real values of the FP8 inputs (each times its descale)."""
    sc = scales_of(operands)
    exact = config.replace(dtype="float64")
    return exact, operands.replace(
        query=operands.query.astype(np.float64) * sc["descale_q"],
        key=operands.key.astype(np.float64) * sc["descale_k"],
        value=operands.value.astype(np.float64) * sc["descale_v"], fp8_scales=None)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def assert_fp8_rule(name: str, gpu: np.ndarray, emulated: np.ndarray, exact: np.ndarray, dtype: str) -> None:
    """FlashAttention's rule against exact float64: error <= 2 x the emulation's error + MARGIN."""
    gpu_error, emulation_error = relative_error(gpu, exact), relative_error(emulated, exact)
    bound = 2 * emulation_error + MARGIN
    assert gpu_error <= bound, (f"{name}: relative error {gpu_error:.3e} against float64 > 2 x the emulation's "
                                f"{emulation_error:.3e} + {MARGIN} ({dtype})")


def subnormal_rounding(dtype: str) -> float:
    """The absolute rounding of a value below the smallest normal: half the smallest subnormal."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).smallest_subnormal) / 2


def softmax_facts(exact_config, exact_operands) -> tuple[float, float, float]:
    """``max P``, ``max_i sum_j P_ij |v_j|`` and ``max |v|`` of the exact problem."""
    problem = load(exact_config, exact_operands)
    s, _ = scores(problem, exact_config.scale)
    p, _ = softmax(s, problem.sink)
    spread = np.einsum("bnts,bnsd->bntd", p, np.abs(problem.v)).max()
    return float(p.max()), float(spread), float(np.abs(problem.v).max())


def assert_amax_s(got: float, max_p: float, config, descale_s: float) -> None:
    """``amax_s = max_i 1 / l_i`` with ``l_i = sum_j exp(s_ij - m_i)`` (= max P).  Should cuDNN sum the
    FP8-rounded terms, each is off by at most ``u`` relative (``eta`` absolute below the normal range, in
    units of ``scale_s``), so ``l`` and ``1 / l`` by ``u + S eta descale_s`` relative."""
    tolerance = ROUNDING[config.dtype] + config.kv_len * subnormal_rounding(config.dtype) * descale_s
    assert abs(got - max_p) <= tolerance * max_p, (
        f"amax_s {got:.6g} != max P {max_p:.6g} (within {tolerance:.3g} relative; the maximum of the unnormalised "
        "terms exp(s - max) would be 1)")


def assert_amax_o(got: float, max_o: float, spread: float, max_v: float, config, descale_s: float) -> None:
    """``amax_o = max |O|`` before ``scale_o``.  Rounding each P term to FP8 moves ``O_i`` by at most
    ``u sum_j P_ij |v_j| + S eta descale_s max |v|``; twice that covers a normaliser summed from the
    rounded terms."""
    bound = 2 * (ROUNDING[config.dtype] * spread + config.kv_len * subnormal_rounding(config.dtype) * descale_s * max_v)
    assert abs(got - max_o) <= bound, f"amax_o {got:.6g} != max |O| {max_o:.6g} (within {bound:.3g})"


# -- forward -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(FORWARD), ids=list(FORWARD))
def test_forward_through_the_public_api(case, rng):
    """The seed's form ``(output, amax_s, amax_o)``; the output, dequantised, follows FlashAttention's
    rule; the native call into a NaN-filled buffer writes every element, the same values."""
    config = fp8_config(FORWARD[case], training=False)
    operands = random_operands(config, rng, poison=False)
    gpu = device_operands(operands)
    output, amax_s, amax_o = cudnn_attn.dot_product_attention(gpu.query, gpu.key, gpu.value,
                                                              **public_kwargs(config, operands))
    assert output.dtype == np.uint8 and output.shape == config.o_shape
    assert amax_s.shape == amax_o.shape == (1, 1, 1, 1) and amax_s.dtype == amax_o.dtype == np.float32
    sc = scales_of(operands)
    native = prepared.forward(config, gpu, output=poisoned_bytes(config.o_shape))
    same = relative_error(dequantised(native.output, config.dtype, 1.0), dequantised(output, config.dtype, 1.0))
    assert same <= ROUNDING[config.dtype], f"the native call into a NaN-filled buffer differs by {same:.3e}"
    emulated = reference.forward(config, operands)
    exact_config, exact_operands = exact_problem(config, operands)
    exact = reference.forward(exact_config, exact_operands).output
    assert_fp8_rule("output", dequantised(output, config.dtype, 1 / sc["scale_o"]),
                    dequantised(emulated.output, config.dtype, 1 / sc["scale_o"]), exact, config.dtype)
    max_p, spread, max_v = softmax_facts(exact_config, exact_operands)
    assert_amax_s(value(cp.asnumpy(amax_s)), max_p, config, sc["descale_s"])
    assert_amax_o(value(cp.asnumpy(amax_o)), float(np.abs(exact).max()), spread, max_v, config, sc["descale_s"])


def test_amax_bounds_hold_for_the_emulation(rng):
    """The amax bounds above are not vacuous: the emulation, which rounds P at other points than
    cuDNN, meets them; and they reject the neighbouring wrong semantics (amax_s of the unnormalised
    terms, amax_o after scale_o)."""
    config = fp8_config(FORWARD["e4m3-d128-BNTH"], training=False)
    operands = random_operands(config, rng, poison=False)
    sc = scales_of(operands)
    emulated = reference.forward(config, operands)
    exact_config, exact_operands = exact_problem(config, operands)
    max_o = float(np.abs(reference.forward(exact_config, exact_operands).output).max())
    max_p, spread, max_v = softmax_facts(exact_config, exact_operands)
    assert_amax_s(value(emulated.amax_s), max_p, config, sc["descale_s"])
    assert_amax_o(value(emulated.amax_o), max_o, spread, max_v, config, sc["descale_s"])
    with pytest.raises(AssertionError):
        assert_amax_s(1.0, max_p, config, sc["descale_s"])          # max of exp(s - max) is always 1
    with pytest.raises(AssertionError):
        assert_amax_o(value(emulated.amax_o) * sc["scale_o"], max_o, spread, max_v, config, sc["descale_s"])


# -- backward ------------------------------------------------------------------------------------------
def with_backward_scales(config, operands, output: np.ndarray, logsumexp: np.ndarray, rng):
    """A random dO quantised with its own power-of-two scale, and ``scale_dQ/dK/dV/dP`` from the amax
    values of a first, unit-scaled pass of the emulation (delayed scaling, as FP8 training does)."""
    dtype = np.dtype(config.dtype)
    gradient = rng.standard_normal(config.o_shape)
    scale_do = fp8_scale(float(np.abs(gradient).max()), dtype)
    d_out = cast(gradient * scale_do, dtype)

    def scalar(x):
        return np.full((1, 1, 1, 1), x, np.float32)

    scales = {**operands.fp8_scales, "descale_dO": scalar(1 / scale_do)}
    first = reference.backward(config, operands.replace(fp8_scales=scales), output, d_out, logsumexp)
    for name, amax in (("dQ", first.amax_dQ), ("dK", first.amax_dK), ("dV", first.amax_dV), ("dP", first.amax_dP)):
        scales[f"scale_{name}"] = scalar(fp8_scale(value(amax), dtype))
    scales["descale_dP"] = scalar(1 / value(scales["scale_dP"]))
    return operands.replace(fp8_scales=scales), d_out


@pytest.mark.parametrize("case", list(BACKWARD), ids=list(BACKWARD))
def test_backward_through_the_public_api(case, rng):
    """Forward in training mode (native API: the seed's FP8 form returns no logsumexp) into NaN-filled
    results, then ``dot_product_attention_bwd(use_fp8=True)``: dq/dk/dv follow FlashAttention's rule
    against float64 backpropagating the same O, dO and logsumexp; amax_dQ/dK/dV/dP match the emulation."""
    config = fp8_config(BACKWARD[case], training=True)
    operands = random_operands(config, rng, poison=False)
    gpu = device_operands(operands)
    forward = prepared.forward(config, gpu, output=poisoned_bytes(config.o_shape),
                                logsumexp=cp.full(config.lse_shape, np.nan, cp.float32))
    output, logsumexp = host_fp8(forward.output, config.dtype), cp.asnumpy(forward.logsumexp)
    dequantised(output, config.dtype, 1.0)                       # every element written
    assert_lse_close(forward.logsumexp, reference.forward(config, operands).logsumexp)

    operands, d_out = with_backward_scales(config, operands, output, logsumexp, rng)
    sc = scales_of(operands)
    grads = cudnn_attn.dot_product_attention_bwd(gpu.query, gpu.key, gpu.value, forward.output, device_bytes(d_out),
                                                 forward.logsumexp, **public_kwargs(config, operands))
    emulated = reference.backward(config, operands, output, d_out, logsumexp)
    exact_config, exact_operands = exact_problem(config, operands)
    exact = reference.backward(exact_config, exact_operands, output.astype(np.float64) * sc["descale_o"],
                               d_out.astype(np.float64) * sc["descale_dO"], logsumexp)
    for name, scale, shape in GRADIENTS:
        got = getattr(grads, name)
        assert got.dtype == np.uint8 and got.shape == getattr(config, shape)
        assert_fp8_rule(name, dequantised(got, config.dtype, 1 / sc[f"scale_{scale}"]),
                        dequantised(getattr(emulated, name), config.dtype, 1 / sc[f"scale_{scale}"]),
                        getattr(exact, name), config.dtype)
    for name in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP"):
        got, want = value(cp.asnumpy(getattr(grads, name))), value(getattr(emulated, name))
        assert abs(got - want) <= ROUNDING[config.dtype] * want, f"{name}: {got:.6g} != emulation {want:.6g}"

    native = prepared.backward(config, device_operands(operands), forward.output, device_bytes(d_out),
                                forward.logsumexp, **{name: poisoned_bytes(getattr(config, shape))
                                                      for name, _, shape in GRADIENTS})
    for name, scale, _ in GRADIENTS:    # every element written; equal up to the order of cuDNN's dQ accumulation
        again = dequantised(getattr(native, name), config.dtype, 1 / sc[f"scale_{scale}"])
        first = dequantised(getattr(grads, name), config.dtype, 1 / sc[f"scale_{scale}"])
        assert relative_error(again, first) <= ROUNDING[config.dtype], name


# -- refusals before any GPU work ----------------------------------------------------------------------
REFUSED = {
    # name: (case, training, what the reason mentions)
    "backward-d64": (dict(H=64), True, "128"),
    "training-T192": (dict(T=192, S=192), True, "128"),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_unsupported_fp8_calls_are_refused_before_building(case, rng):
    """The support table refuses what the H200's cuDNN cannot run (the sm90 FP8 backward takes head dim
    128 only; FP8 training needs T and S multiples of 128): no graph is built."""
    shape, training, mentioned = REFUSED[case]
    config = fp8_config(shape, training=training)
    operands = random_operands(config, rng, poison=False)
    gpu = device_operands(operands)
    kwargs = public_kwargs(config, operands)
    before = graph_cache.stats()
    with pytest.raises(UnsupportedConfigurationError) as raised:
        if case.startswith("backward"):
            out, d_out = poisoned_bytes(config.o_shape), poisoned_bytes(config.o_shape)
            cudnn_attn.dot_product_attention_bwd(gpu.query, gpu.key, gpu.value, out, d_out,
                                                 cp.zeros(config.lse_shape, cp.float32), **kwargs)
        else:
            cudnn_attn.dot_product_attention(gpu.query, gpu.key, gpu.value, return_residual=True, **kwargs)
    assert any(mentioned in reason for reason in raised.value.reasons), raised.value.reasons
    after = graph_cache.stats()
    assert (after.entries, after.build_seconds) == (before.entries, before.build_seconds)


@pytest.mark.parametrize("change, argument", [
    (dict(fp8_dtype="e4m3"), "fp8_dtype"),
    (dict(fp8_params=None), "fp8_params"),
], ids=["unknown-format", "no-params"])
def test_invalid_fp8_calls_are_value_errors(change, argument, rng):
    config = fp8_config({}, training=False)
    operands = random_operands(config, rng, poison=False)
    gpu = device_operands(operands)
    with pytest.raises(ValueError, match=argument):
        cudnn_attn.dot_product_attention(gpu.query, gpu.key, gpu.value, **{**public_kwargs(config, operands), **change})


def test_fp8_with_a_padding_mask_is_refused_by_the_support_table(rng):
    """Well formed, so not a ValueError: the support table's FP8 row refuses it, before any build."""
    config = fp8_config({}, training=False)
    operands = random_operands(config, rng, poison=False)
    gpu = device_operands(operands)
    lengths = cp.full((config.batch,), config.q_len, cp.int32)
    before = graph_cache.stats()
    with pytest.raises(UnsupportedConfigurationError) as raised:
        cudnn_attn.dot_product_attention(gpu.query, gpu.key, gpu.value, q_seqlen=lengths, kv_seqlen=lengths,
                                         **{**public_kwargs(config, operands), "mask_type": MaskType.PADDING})
    assert any("FP8" in reason and "mask" in reason for reason in raised.value.reasons), raised.value.reasons
    assert graph_cache.stats().entries == before.entries


def test_fp16_inputs_with_use_fp8_are_a_value_error(rng):
    config = fp8_config({}, training=False)
    operands = random_operands(config, rng, poison=False)
    q = cp.asarray(operands.query.astype(np.float16))
    with pytest.raises(ValueError, match="query"):
        cudnn_attn.dot_product_attention(q, q, q, **public_kwargs(config, operands))
