"""support: the Environment, one case per requirement/restriction row, and check_supported.

Each case states the reason it expects and who enforces it, and checks that the same configuration
without the offending feature (or in a capable environment) has no reason at all, so every case can
fail both ways.
"""

from __future__ import annotations

import pytest

from cudnn_attn.core import environment, support
from cudnn_attn.core.config import (
    AttentionConfig,
    BiasSpec,
    DiagonalAlignment,
    PackingSpec,
    PagingSpec,
    StaticMask,
)
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.score_mod_spec import score_mod_spec
from cudnn_attn.core.support import (
    CUDNN,
    LIBRARY,
    REQUIREMENTS,
    RESTRICTIONS,
    SCORE_MOD_MAX_ARGS,
    Environment,
    check_supported,
    format_version,
    not_supported_reasons,
)
from cudnn_attn.core.types import AttentionLayout

SM90 = Environment.sm90()
SM100 = Environment(91900, (10, 0), "B200")
BASE = AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=128, kv_len=128, qk_dim=64, v_dim=64, dtype="float16")
FP8 = BASE.replace(dtype="float8_e4m3fn", qk_dim=128, v_dim=128)
CAUSAL = StaticMask(right_bound=0)
BOTTOM_RIGHT = StaticMask(right_bound=0, alignment=DiagonalAlignment.BOTTOM_RIGHT)
BOTTOM_RIGHT_PADDED = StaticMask(right_bound=0, alignment=DiagonalAlignment.BOTTOM_RIGHT, padding=True)
WINDOW = StaticMask(right_bound=0, left_bound=32)
PADDING = StaticMask(padding=True)
BIAS = BiasSpec(shape=(1, 4, 128, 128), differentiable=True)
PACKED = dict(packing=PackingSpec(max_segments=2), mask=PADDING)
PAGED = dict(paging=PagingSpec(num_blocks_k=8, num_blocks_v=8, block_size=32, blocks_per_seq=4), mask=PADDING)


def score_mod(score):
    return score


def scaled_score_mod(score, *factors):
    for factor in factors:
        score = score * factor
    return score


SCORES = (2, 4, 128, 128)                     # (B, N, T, S) of BASE
SCORE_MOD = score_mod_spec(score_mod, SCORES)


def scaled(*arg_shapes):
    """The spec of ``scaled_score_mod`` with arguments of these ``(shape, dtype)``."""
    return score_mod_spec(scaled_score_mod, SCORES, arg_shapes)


def env(version=91900, capability=(9, 0)):
    return Environment(version, capability, "test GPU")


def test_format_version():
    assert [format_version(v) for v in (91900, 8904, 90100, 91002, 92600)] == \
        ["9.19.0", "8.9.4", "9.1.0", "9.10.2", "9.26.0"]


def test_sm90_environment():
    assert SM90 == Environment(91900, (9, 0), "NVIDIA H200, deviceless")
    assert Environment.sm90(92800).cudnn_version == 92800
    assert str(SM90) == "cuDNN 9.19.0, sm90 (NVIDIA H200, deviceless)"
    assert str(Environment(None, None)) == "no cuDNN, no CUDA GPU"


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(_has_gpu(), reason="checks the CPU-only answer")
def test_detect_on_a_machine_without_gpu():
    detected = Environment.detect()
    assert detected.compute_capability is None and detected.device_name is None
    assert detected.cudnn_version is None or detected.cudnn_version >= 8000
    assert "no CUDA GPU with cuDNN found" in not_supported_reasons(BASE)
    with pytest.raises(UnsupportedConfigurationError, match="no CUDA GPU with cuDNN found"):
        check_supported(BASE)


def test_detect_reads_the_current_cupy_device(monkeypatch):
    cupy = pytest.importorskip("cupy")
    runtime = cupy.cuda.runtime
    monkeypatch.setattr(runtime, "getDeviceCount", lambda: 2)
    monkeypatch.setattr(runtime, "getDevice", lambda: 1)
    monkeypatch.setattr(runtime, "getDeviceProperties",
                        lambda i: {"major": 9, "minor": 0, "name": f"NVIDIA H200 #{i}".encode(),
                                   "multiProcessorCount": 132})
    environment._device_facts.cache_clear()
    try:
        detected = Environment.detect()
    finally:
        environment._device_facts.cache_clear()
    assert (detected.compute_capability, detected.device_name) == ((9, 0), "NVIDIA H200 #1")


def test_detect_without_cudnn(monkeypatch):
    cudnn = pytest.importorskip("cudnn")

    def missing():
        raise RuntimeError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(cudnn, "backend_version", missing)
    environment._forget()
    try:
        detected = Environment.detect()
    finally:
        environment._forget()
    assert detected.cudnn_version is None
    assert "no cuDNN library found (install nvidia-cudnn-cu13)" in not_supported_reasons(BASE, detected)


# -- configurations sm90 with cuDNN 9.19 runs (each also built deviceless) ---------------------------

SUPPORTED_ON_SM90 = {
    "plain-inference": BASE,
    "plain-training": BASE.replace(training=True),
    "bf16-causal-training": BASE.replace(dtype="bfloat16", mask=CAUSAL, training=True),
    "gqa-8:2": BASE.replace(q_heads=8, kv_heads=2, training=True),
    "mla-128/256": BASE.replace(qk_dim=128, v_dim=256, training=True),
    "d256-training": BASE.replace(qk_dim=256, v_dim=256, training=True),
    "alibi-dropout": BASE.replace(mask=StaticMask(right_bound=0, alibi=True), dropout_rate=0.1, training=True),
    "bottom-right-T<S": BASE.replace(q_len=64, mask=BOTTOM_RIGHT, training=True),
    "window-bias-dropout": BASE.replace(mask=WINDOW, bias=BIAS, dropout_rate=0.1, training=True),
    "score_mod-bias": BASE.replace(score_mod=SCORE_MOD, bias=BIAS, training=True),
    "sink-training": BASE.replace(sink=True, training=True),
    "decode-T1": BASE.replace(q_len=1, training=True),
    "backward-T1-S1": BASE.replace(q_len=1, kv_len=1, training=True),          # run padded (cudnn_attn.core.padded_call)
    "bias-training-odd-T": BASE.replace(bias=BIAS, q_len=127, training=True),   # run padded (cudnn_attn.core.padded_call)
    "packed-gqa": BASE.replace(q_heads=8, kv_heads=2, training=True, **PACKED),
    "paged-d256": BASE.replace(qk_dim=256, v_dim=256, **PAGED),
    "fp8-causal-training": FP8.replace(mask=CAUSAL, training=True),
    "fp8-d64-inference": FP8.replace(qk_dim=64, v_dim=64),
}


@pytest.mark.parametrize("config", SUPPORTED_ON_SM90.values(), ids=SUPPORTED_ON_SM90.keys())
def test_supported_on_sm90(config):
    assert not_supported_reasons(config, SM90) == []
    check_supported(config, SM90)


# -- one case per rule ------------------------------------------------------------------------------

CASES = [
    # (id, config, environment, expected reason, enforced by, the fix: a config or environment without it)
    # REQUIREMENTS
    ("old-cudnn", BASE, env(8900, (8, 0)), "fused attention (fp16/bf16): needs cuDNN >= 8.9.4, found 8.9.0",
     CUDNN, env(8904, (8, 0))),
    ("broken-cudnn-9.10.1", BASE, env(91001), "fused attention (fp16/bf16): cuDNN 9.10.1 is excluded (known bugs)",
     CUDNN, env(91002)),
    ("turing", BASE, env(91900, (7, 5)), "fused attention (fp16/bf16): needs compute capability >= sm80, found sm75",
     CUDNN, env(91900, (8, 0))),
    ("fp8-ampere", FP8, env(91900, (8, 6)), "FP8 attention: needs compute capability >= sm90, found sm86",
     CUDNN, SM90),
    ("fp8-cudnn-9.0", FP8, env(90000), "FP8 attention: needs cuDNN >= 9.1.0, found 9.0.0", CUDNN, env(90100)),
    ("fp8-broken-9.10.0", FP8, env(91000), "FP8 attention: cuDNN 9.10.0 is excluded (known bugs)", CUDNN, env(91001)),
    ("fp8-bottom-right-hopper", FP8.replace(mask=BOTTOM_RIGHT), SM90,
     "FP8 bottom-right causal mask: needs compute capability >= sm100, found sm90", CUDNN, SM100),
    ("window-cudnn-9.1", BASE.replace(mask=WINDOW), env(90100), "sliding window: needs cuDNN >= 9.2.0, found 9.1.0",
     CUDNN, env(90200)),
    ("window-bias-cudnn-9.9", BASE.replace(mask=WINDOW, bias=BIAS), env(90900),
     "sliding window with bias or dropout: needs cuDNN >= 9.10.2, found 9.9.0", CUDNN, env(91002)),
    ("bottom-right-cudnn-9.5", BASE.replace(mask=BOTTOM_RIGHT), env(90500),
     "bottom-right causal mask: needs cuDNN >= 9.6.0, found 9.5.0", CUDNN, env(90600)),
    ("paged-cudnn-9.4", BASE.replace(**PAGED), env(90400), "paged K/V cache: needs cuDNN >= 9.5.0, found 9.4.0",
     CUDNN, env(90500)),
    ("paged-d256-cudnn-9.9", BASE.replace(qk_dim=256, v_dim=256, **PAGED), env(90900),
     "paged K/V cache with head dim > 128: needs cuDNN >= 9.10.0", CUDNN, env(91002)),
    ("packed-ampere", BASE.replace(**PACKED), env(91900, (8, 0)),
     "packed segments: needs compute capability >= sm90, found sm80", CUDNN, SM90),
    ("packed-gqa-training-9.5", BASE.replace(q_heads=8, kv_heads=2, training=True, **PACKED), env(90500),
     "packed segments with GQA (backward): needs cuDNN >= 9.6.0, found 9.5.0", CUDNN, env(90600)),
    ("packed-sink-training", BASE.replace(sink=True, training=True, **PACKED), SM90,
     "packed segments with a sink (backward): needs cuDNN >= 9.26.0, found 9.19.0", CUDNN, env(92600)),
    ("dbias-padding-9.4", BASE.replace(bias=BIAS, mask=PADDING, training=True), env(90400),
     "dbias with padding (backward): needs cuDNN >= 9.5.0, found 9.4.0", CUDNN, env(90500)),
    ("mla-cudnn-9.9", BASE.replace(v_dim=128), env(90900),
     "multi-head latent attention (v_dim != qk_dim): needs cuDNN >= 9.10.0, found 9.9.0", CUDNN, env(91002)),
    ("mla-ampere", BASE.replace(v_dim=128), env(91900, (8, 0)),
     "multi-head latent attention (v_dim != qk_dim): needs compute capability >= sm90", CUDNN, SM90),
    ("score_mod-cudnn-9.12", BASE.replace(score_mod=SCORE_MOD), env(91200),
     "score_mod: needs cuDNN >= 9.13.0, found 9.12.0", LIBRARY, env(91300)),
    ("sink-cudnn-9.12", BASE.replace(sink=True), env(91200), "attention sink: needs cuDNN >= 9.13.0, found 9.12.0",
     CUDNN, env(91300)),
    # RESTRICTIONS enforced by cuDNN
    ("head-dim-60", BASE.replace(qk_dim=60, v_dim=60), SM90, "head dim: 60 is not a multiple of 8", CUDNN,
     BASE.replace(qk_dim=64, v_dim=64)),
    ("fp8-head-dim-40", FP8.replace(qk_dim=40, v_dim=40), SM90, "head dim: 40 is not a multiple of 16", CUDNN,
     FP8.replace(qk_dim=48, v_dim=48)),
    ("head-dim-320-training", BASE.replace(qk_dim=320, v_dim=320, training=True), SM90,
     "head dim: 320 > 256 in the backward (sm90 maximum)", CUDNN, BASE.replace(qk_dim=256, v_dim=256, training=True)),
    ("sm100-backward-160", BASE.replace(qk_dim=160, v_dim=160, training=True), SM100,
     "head dim: (160, 160) in the backward (sm100 serves", CUDNN, BASE.replace(qk_dim=192, v_dim=128, training=True)),
    ("alibi-without-causal", BASE.replace(mask=StaticMask(alibi=True)), SM90, "ALiBi: needs a causal mask", CUDNN,
     BASE.replace(mask=StaticMask(alibi=True, right_bound=0))),
    ("bottom-right-padding-bias-dropout", BASE.replace(mask=BOTTOM_RIGHT_PADDED, bias=BIAS, dropout_rate=0.1), SM90,
     "bottom-right causal mask: cannot be combined with bias and a padding mask, dropout", CUDNN,
     BASE.replace(mask=BOTTOM_RIGHT, bias=BIAS, dropout_rate=0.1)),
    ("bottom-right-dropout", BASE.replace(mask=BOTTOM_RIGHT, dropout_rate=0.1), SM90,
     "bottom-right causal mask: cannot be combined with dropout", CUDNN, BASE.replace(mask=BOTTOM_RIGHT)),
    ("bottom-right-T>S", BASE.replace(mask=BOTTOM_RIGHT, q_len=192), SM90,
     "bottom-right causal mask: needs T <= S without padding, found T=192 > S=128", CUDNN,
     BASE.replace(mask=StaticMask(right_bound=0, padding=True, alignment=DiagonalAlignment.BOTTOM_RIGHT), q_len=192)),
    ("window-T>S", BASE.replace(mask=WINDOW, q_len=192), SM90,
     "sliding window: needs T <= S without padding, found T=192 > S=128", CUDNN,
     BASE.replace(mask=WINDOW, q_len=128)),
    ("score_mod-alibi", BASE.replace(score_mod=SCORE_MOD, mask=StaticMask(right_bound=0, alibi=True)), SM90,
     "score_mod: score_mod with ALiBi: cuDNN refuses its ALiBi next to score_mod", LIBRARY,
     BASE.replace(score_mod=SCORE_MOD, mask=StaticMask(right_bound=0, padding=True))),
    ("sink-decode", BASE.replace(sink=True, q_len=1), SM90,
     "attention sink: not supported with a single query (T == 1)", CUDNN, BASE.replace(sink=True, q_len=2)),
    ("deterministic-sm100-old", BASE.replace(deterministic=True, training=True), env(91700, (10, 0)),
     "deterministic backward: needs cuDNN >= 9.18.0 on sm100", CUDNN, env(91800, (10, 0))),
    ("deterministic-sm100-dropout", BASE.replace(deterministic=True, training=True, dropout_rate=0.1), SM100,
     "deterministic backward: not on sm100 with dropout", CUDNN, SM90),
    ("packed-dbias-sm100", BASE.replace(bias=BIAS, training=True, **PACKED), SM100,
     "packed segments with dbias: no dbias on sm100", CUDNN, SM90),
    ("fp8-bias", FP8.replace(bias=BIAS), SM90, "FP8 attention: takes no bias", CUDNN, FP8),
    ("fp8-sink", FP8.replace(sink=True), SM90, "FP8 attention: no attention sink", CUDNN, FP8),
    ("fp8-head-dim-272", FP8.replace(qk_dim=272, v_dim=272), SM90, "FP8 attention: head dim 272 > 256", CUDNN,
     FP8.replace(qk_dim=256, v_dim=256)),
    ("fp8-backward-d64-hopper", FP8.replace(qk_dim=64, v_dim=64, training=True), SM90,
     "FP8 attention: the sm90 backward needs qk_dim == v_dim == 128, found (64, 64)", CUDNN,
     FP8.replace(qk_dim=64, v_dim=64)),
    ("fp8-backward-packed-hopper", FP8.replace(training=True, packing=PackingSpec(2)), SM90,
     "FP8 attention: the sm90 backward does not support packed segments", CUDNN, FP8.replace(training=True)),
    ("paged-training", BASE.replace(training=True, **PAGED), SM90,
     "paged K/V cache: no backward (cuDNN's sdpa_backward takes no page tables)", CUDNN, BASE.replace(**PAGED)),
    # RESTRICTIONS of this library (the seed's policy)
    ("head-dim-320-inference", BASE.replace(qk_dim=320, v_dim=320), SM90, "head dim: 320 > 256 (sm90 maximum)",
     LIBRARY, BASE.replace(qk_dim=256, v_dim=256)),
    ("head-dim-160-ampere", BASE.replace(qk_dim=160, v_dim=160), env(91900, (8, 0)),
     "head dim: 160 > 128 (sm80 maximum)", LIBRARY, SM90),
    ("fp8-padding", FP8.replace(mask=PADDING), SM90, "FP8 attention: no mask or a causal mask only, found padding",
     LIBRARY, FP8.replace(mask=CAUSAL)),
    ("fp8-dropout-score_mod", FP8.replace(dropout_rate=0.1, score_mod=SCORE_MOD), SM90,
     "FP8 attention: no dropout, score_mod (the seed's FP8 path has neither)", LIBRARY, FP8),
    ("fp8-training-d64-blackwell", FP8.replace(qk_dim=64, v_dim=64, training=True), SM100,
     "FP8 attention: training needs qk_dim == v_dim == 128, found (64, 64)", LIBRARY, FP8.replace(training=True)),
    ("fp8-training-T100", FP8.replace(q_len=100, training=True), SM90,
     "FP8 attention: training needs T and S multiples of 128, found T=100, S=128", LIBRARY, FP8.replace(q_len=100)),
    ("packed-bias", BASE.replace(bias=BIAS, **PACKED), SM90, "packed segments: cannot be combined with bias",
     LIBRARY, BASE.replace(**PACKED)),
    ("packed-paged", BASE.replace(paging=PAGED["paging"], **PACKED), SM90,
     "packed segments: cannot be combined with paged K/V", LIBRARY, BASE.replace(**PACKED)),
    ("score_mod-9-args", BASE.replace(score_mod=scaled(*[((), "float32")] * 9)), SM90,
     "score_mod: takes at most 8 arguments, found 9", LIBRARY, BASE.replace(score_mod=scaled(*[((), "float32")] * 8))),
    ("score_mod-vector-arg", BASE.replace(score_mod=scaled(((1, 1, 1, 1), "float32"), ((128,), "float32"))), SM90,
     "score_mod: arguments must be scalars (bound by value), found shapes [(1, 1, 1, 1), (128,)]", LIBRARY,
     BASE.replace(score_mod=scaled(((1, 1, 1, 1), "float32"),))),
    ("sm103-old-cudnn", BASE, env(91000, (10, 3)), "GPU: sm103 needs cuDNN >= 9.11.0, found 9.10.0", LIBRARY,
     env(91100, (10, 3))),
    ("float32", BASE.replace(dtype="float32"), SM90, "input dtype: float32 (cuDNN takes float16, bfloat16", CUDNN,
     BASE),
    ("float64", BASE.replace(dtype="float64"), SM90, "float64 runs in the NumPy reference only", CUDNN, BASE),
]


@pytest.mark.parametrize("config, environment, reason, enforced_by, fixed",
                         [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_each_rule_reports_one_reason(config, environment, reason, enforced_by, fixed):
    reasons = not_supported_reasons(config, environment)
    assert any(reason in r for r in reasons), reasons
    assert any(reason in r for r in not_supported_reasons(config, environment, enforced_by=enforced_by))
    other = LIBRARY if enforced_by == CUDNN else CUDNN
    assert not any(reason in r for r in not_supported_reasons(config, environment, enforced_by=other))
    if isinstance(fixed, Environment):
        config_fixed, env_fixed = config, fixed
    else:
        config_fixed, env_fixed = fixed, environment
    assert not any(reason in r for r in not_supported_reasons(config_fixed, env_fixed)), "the fix does not clear it"


def test_reasons_accumulate_and_do_not_repeat():
    config = FP8.replace(qk_dim=64, v_dim=64, training=True, q_len=100, dropout_rate=0.1, bias=BIAS)
    reasons = not_supported_reasons(config, SM90)
    assert len(reasons) == len(set(reasons)) == 4, reasons
    assert not_supported_reasons(BASE.replace(qk_dim=320, v_dim=320, training=True), SM90) == \
        ["head dim: 320 > 256 in the backward (sm90 maximum)"]


def test_missing_gpu_and_cudnn_are_reasons_of_their_own():
    reasons = not_supported_reasons(BASE.replace(qk_dim=60), Environment(None, None))
    assert reasons == ["no cuDNN library found (install nvidia-cudnn-cu13)", "no CUDA GPU with cuDNN found",
                       "head dim: 60 is not a multiple of 8"]
    assert not_supported_reasons(BASE, Environment(None, None), enforced_by=CUDNN) == []


def test_check_supported_raises_with_reasons_config_and_environment():
    config = BASE.replace(mask=BOTTOM_RIGHT_PADDED, bias=BIAS)
    with pytest.raises(UnsupportedConfigurationError) as raised:
        check_supported(config, SM90)
    error = raised.value
    assert isinstance(error, NotImplementedError)
    assert error.reasons == ["bottom-right causal mask: cannot be combined with bias and a padding mask"]
    assert error.config is config and error.environment is SM90
    assert "  - bottom-right causal mask: cannot be combined with bias and a padding mask" in str(error)
    assert "environment: cuDNN 9.19.0, sm90 (NVIDIA H200, deviceless)" in str(error)


def test_every_table_row_names_its_enforcer():
    rows = (*REQUIREMENTS, *RESTRICTIONS)
    assert all(row.feature and row.enforced_by in (CUDNN, LIBRARY) for row in rows)
    assert all(req.min_cudnn >= 8904 and req.min_compute >= (8, 0) for req in REQUIREMENTS)


def test_score_mod_argument_limit_matches_the_graph_tensor_ids():
    tensors = pytest.importorskip("cudnn_attn.graphs.tensors")
    assert SCORE_MOD_MAX_ARGS == len([tid for tid in tensors.TensorId if tid.name.startswith("SCORE_MOD_ARG_")])


def test_kind_selects_the_graphs_asked_about():
    """A paged forward may return the logsumexp (training=True); only its backward is refused."""
    paged = BASE.replace(training=True, **PAGED)
    assert support.not_supported_reasons(paged, SM90, kind="fwd") == []
    assert support.not_supported_reasons(paged, SM90, kind="bwd") == [
        "paged K/V cache: no backward (cuDNN's sdpa_backward takes no page tables)"]
    assert support.not_supported_reasons(paged, SM90) == support.not_supported_reasons(paged, SM90, kind="bwd")


# -- fronts and the environment-free questions --------------------------------------------------------

def test_the_reference_front_refuses_only_what_no_front_runs():
    """The reference needs no GPU or cuDNN and runs what cuDNN would refuse on a GPU (a head dim of 320 in
    training); it refuses only the rows every front shares, with the reasons check_supported gives."""
    unsupported_on_gpus = BASE.replace(qk_dim=320, v_dim=320, training=True)
    assert not_supported_reasons(unsupported_on_gpus, SM90)
    assert not_supported_reasons(unsupported_on_gpus, front="reference") == []
    assert not_supported_reasons(unsupported_on_gpus, Environment(None, None), front="reference") == []
    assert not_supported_reasons(BASE.replace(dtype="float64"), front="reference") == []   # its exact mode
    paged = BASE.replace(training=True, **PAGED)
    everywhere = ["paged K/V cache: no backward (cuDNN's sdpa_backward takes no page tables)"]
    assert not_supported_reasons(paged, front="reference") == everywhere
    assert set(everywhere) <= set(not_supported_reasons(paged, SM90, front="cupy"))
    with pytest.raises(UnsupportedConfigurationError) as raised:
        support.check_everywhere(paged)
    assert raised.value.reasons == everywhere


def test_the_jax_front_adds_its_own_rows():
    """score_mod arguments are traced arrays under JAX: refused on the JAX front only (the CuPy front binds
    them by value, the reference evaluates them)."""
    config = BASE.replace(score_mod=scaled(((), "float32")))
    assert not_supported_reasons(config, SM90, front="cupy") == []
    assert not_supported_reasons(config, front="reference") == []
    jax_reasons = not_supported_reasons(config, SM90, front="jax")
    assert len(jax_reasons) == 1 and "score_mod arguments are traced arrays" in jax_reasons[0]
    assert not_supported_reasons(BASE.replace(score_mod=SCORE_MOD), SM90, front="jax") == []


def test_structural_rows_are_what_the_builder_cannot_declare():
    """check_structure raises the rows the graph builder cannot express for one graph, in any environment;
    rows that only a GPU or cuDNN version decides are not among them."""
    paged = BASE.replace(training=True, **PAGED)
    support.check_structure(paged, kind="fwd")
    with pytest.raises(UnsupportedConfigurationError, match="no backward") as raised:
        support.check_structure(paged, kind="bwd")
    assert raised.value.config is paged and raised.value.environment is None
    support.check_structure(BASE.replace(qk_dim=320, v_dim=320, training=True), kind="bwd")   # cuDNN's to refuse
    with pytest.raises(UnsupportedConfigurationError, match="BTNH"):
        support.check_structure(BASE.replace(layout=AttentionLayout.BNTH, **PACKED), kind="fwd")


@pytest.mark.parametrize("front", ["cupy", "jax", "reference"])
@pytest.mark.parametrize("config", [
    BASE, FP8.replace(bias=BIAS, mask=StaticMask(alibi=True), dropout_rate=0.5, sink=True, training=True),
    BASE.replace(layout=AttentionLayout.BNTH, bias=BIAS, training=True, **PAGED),
    BASE.replace(packing=PackingSpec(max_segments=2), paging=PAGED["paging"], score_mod=scaled(((1, 128), "float32"))),
], ids=["plain", "fp8-everything", "paged-bnth-bias", "packed-paged-score_mod"])
def test_the_table_never_raises_for_a_configuration(config, front):
    for env in (SM90, SM100, Environment(None, None), Environment(80000, (7, 0))):
        for kind in (None, "fwd", "bwd"):
            assert isinstance(not_supported_reasons(config, env, kind=kind, front=front), list)


def test_a_bad_front_is_an_argument_error():
    with pytest.raises(ValueError, match="front: expected one of 'cupy', 'jax', 'reference'"):
        not_supported_reasons(BASE, SM90, front="torch")


def test_what_a_lift_serves_is_not_refused_but_the_builder_cannot_declare_it():
    """Packed BNTH runs as BTNH, bottom-right causal with a bias (no padding) folded into the bias
    (cudnn_attn.core.padded_call): no front refuses them; the builder is only ever given the lifted call."""
    packed_bnth = BASE.replace(layout=AttentionLayout.BNTH, training=True, **PACKED)
    assert not_supported_reasons(packed_bnth, SM90) == []
    with pytest.raises(UnsupportedConfigurationError, match="need the token-major BTNH layout"):
        support.check_structure(packed_bnth, kind="fwd")
    assert not_supported_reasons(BASE.replace(mask=BOTTOM_RIGHT, bias=BIAS, dropout_rate=0.1, training=True),
                                 SM90) == []
