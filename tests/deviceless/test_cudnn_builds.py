"""cuDNN 9.19 builds an sm90 plan for every feature, forward and backward (deviceless).

Each row is one feature on the small base call of ``matrix.config``; a failure prints cuDNN's own
refusal.  The plans must be cuDNN backend plans (names ``eng<N>...``), never the frontend's python engines.
"""

from __future__ import annotations

import pytest

from cudnn_attn.core.config import StaticMask
from cudnn_attn.core.padded_call import lifted_config
from cudnn_attn.graphs import ALL_PLANS, TensorId

from .matrix import (
    BNTH,
    BOTTOM_RIGHT,
    BR_PADDING_CAUSAL,
    CAUSAL,
    PADDING,
    PADDING_CAUSAL,
    SOFTCAP,
    B,
    N,
    S,
    T,
    bias,
    config,
    fp8,
    packed,
    paged,
)

pytestmark = pytest.mark.deviceless

FWD_BWD = ("fwd", "bwd")
FWD = ("fwd",)

ROWS = {
    "fp16-BTNH": (config(), FWD_BWD),
    "bf16-BNTH": (config(dtype="bfloat16", layout=BNTH), FWD_BWD),
    "inference": (config(training=False), FWD),
    "causal": (config(mask=CAUSAL), FWD_BWD),
    "causal-BNTH-bf16": (config(mask=CAUSAL, layout=BNTH, dtype="bfloat16"), FWD_BWD),
    "padding": (config(mask=PADDING), FWD_BWD),
    "padding-causal-bottom-right": (config(mask=BR_PADDING_CAUSAL), FWD_BWD),
    "causal-bottom-right-T<S": (config(q_len=64, mask=StaticMask(right_bound=0, alignment=BOTTOM_RIGHT)), FWD_BWD),
    "alibi-causal": (config(mask=StaticMask(right_bound=0, alibi=True)), FWD_BWD),
    "window-32": (config(mask=StaticMask(right_bound=0, left_bound=32)), FWD_BWD),
    "band-16-8": (config(mask=StaticMask(right_bound=8, left_bound=16)), FWD_BWD),
    "bias-1NTS-dbias": (config(bias=bias((1, N, T, S))), FWD_BWD),
    "bias-B1TS-dbias": (config(bias=bias((B, 1, T, S))), FWD_BWD),
    "bias-BNTS-dbias": (config(bias=bias((B, N, T, S))), FWD_BWD),
    "bias-11TS-mask-only": (config(bias=bias((1, 1, T, S), differentiable=False)), FWD_BWD),
    "dropout": (config(dropout_rate=0.1), FWD_BWD),
    "dropout-bias-padding-causal": (config(dropout_rate=0.2, bias=bias((1, N, T, S)), mask=PADDING_CAUSAL), FWD_BWD),
    "packed-causal": (config(packing=packed(), mask=PADDING_CAUSAL), FWD_BWD),
    "packed-gqa-window": (config(packing=packed(), q_heads=8, kv_heads=2,
                                 mask=StaticMask(right_bound=0, left_bound=32, padding=True)), FWD_BWD),
    "paged-decode": (config(q_len=1, training=False, paging=paged(), mask=BR_PADDING_CAUSAL), FWD),
    "paged-prefill-gqa": (config(q_heads=8, kv_heads=2, training=False, paging=paged(), mask=BR_PADDING_CAUSAL), FWD),
    "paged-BNTH-d256": (config(d=256, layout=BNTH, training=False, paging=paged(), mask=BR_PADDING_CAUSAL), FWD),
    "gqa-8-2": (config(q_heads=8, kv_heads=2, mask=CAUSAL), FWD_BWD),
    "mqa-8-1": (config(q_heads=8, kv_heads=1), FWD_BWD),
    "mla-192-128": (config(qk_dim=192, v_dim=128, scale=192 ** -0.5, mask=CAUSAL), FWD_BWD),
    "d256": (config(d=256), FWD_BWD),
    "T64-S192": (config(q_len=64, kv_len=192), FWD_BWD),
    "sink-causal": (config(sink=True, mask=CAUSAL), FWD_BWD),
    "deterministic": (config(deterministic=True, mask=CAUSAL), ("bwd",)),
    "score_mod-softcap": (config(score_mod=SOFTCAP), FWD_BWD),
    "score_mod-softcap-causal-bias": (config(score_mod=SOFTCAP, mask=CAUSAL,
                                             bias=bias((1, N, T, S), differentiable=False)), FWD_BWD),
    "fp8-e4m3-causal": (fp8(mask=CAUSAL), FWD_BWD),
    "fp8-e4m3-BNTH": (fp8(layout=BNTH), FWD_BWD),
    "fp8-e5m2-inference": (fp8(dtype="float8_e5m2", training=False), FWD),
    "fp8-d64-inference": (fp8(d=64, training=False, mask=CAUSAL), FWD),
}


# Calls that run lifted (cudnn_attn.core.padded_call): what cuDNN is given is the lifted configuration.
LIFTED = {
    "packed-BNTH-causal": (config(packing=packed(), mask=PADDING_CAUSAL, layout=BNTH), FWD_BWD),
    "bottom-right-causal-bias-T<S": (config(q_len=64, mask=StaticMask(right_bound=0, alignment=BOTTOM_RIGHT),
                                            bias=bias((1, N, 64, S))), FWD_BWD),
    "bottom-right-window-bias-dropout": (config(mask=StaticMask(right_bound=0, left_bound=32, alignment=BOTTOM_RIGHT),
                                                bias=bias((B, 1, T, S)), dropout_rate=0.1), FWD_BWD),
}
for _name, (_cfg, _kinds) in LIFTED.items():
    ROWS[f"lifted-{_name}"] = (lifted_config(_cfg), _kinds)

CASES = [pytest.param(cfg, kind, id=f"{name}-{kind}") for name, (cfg, kinds) in ROWS.items() for kind in kinds]


@pytest.mark.parametrize("cfg, kind", CASES)
def test_cudnn_builds_an_sm90_backend_plan(deviceless, cfg, kind):
    verdict = deviceless.verdict(cfg, kind)
    assert verdict.ok, f"cuDNN refused {kind} {cfg.describe()}:\n{verdict.message}"
    assert verdict.plan.startswith("eng"), f"not a cuDNN backend plan: {verdict.plan}"
    assert verdict.workspace >= 0


def test_dropout_rng_dump_is_an_extra_output(deviceless):
    cfg = config(dropout_rate=0.25)
    plain, dumped = deviceless.verdict(cfg, "fwd"), deviceless.verdict(cfg, "fwd", rng_dump=True)
    assert plain.ok and dumped.ok, dumped.message
    assert set(dumped.uids) - set(plain.uids) == {TensorId.RNG_DUMP.name}


def test_all_plans_builds_every_backend_candidate(deviceless):
    verdict = deviceless.verdict(config(mask=CAUSAL), "fwd", plan=ALL_PLANS)
    names = [name for _, name, _ in verdict.plans]
    assert verdict.ok and len(names) > 1, names
    assert len(set(names)) == len(names) and all(n.startswith("eng") for n in names)
    assert verdict.plan == names[0] and len(names) <= verdict.num_plans


def test_a_named_plan_is_rebuilt_exactly(deviceless):
    candidates = deviceless.verdict(config(mask=CAUSAL), "fwd", plan=ALL_PLANS)
    last = candidates.plans[-1][1]
    pinned = deviceless.verdict(config(mask=CAUSAL), "fwd", plan=last)
    assert pinned.ok and pinned.plan == last and [p[1] for p in pinned.plans] == [last]


def test_unknown_plan_name_is_refused(deviceless):
    verdict = deviceless.verdict(config(mask=CAUSAL), "fwd", plan="eng999_k24=1")
    assert not verdict.ok and "eng999_k24=1" in verdict.message


def test_int64_ragged_offsets_for_huge_packed_inputs(deviceless):
    # 2 * 65536 tokens * 128 heads * 128 > 2**31 elements: offsets are declared INT64.
    cfg = config(batch=2, q_len=65536, kv_len=65536, q_heads=128, kv_heads=128, d=128, packing=packed(),
                 mask=PADDING_CAUSAL, training=False)
    verdict = deviceless.verdict(cfg, "fwd")
    assert verdict.ok, verdict.message
