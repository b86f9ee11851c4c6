"""The support table agrees with cuDNN 9.19 on sm90 (deviceless builds).

For every configuration, supported or not: cuDNN accepts what the library hands it - the configuration, or
the lifted one where a lift serves it (``cudnn_attn.core.padded_call``: packed BNTH runs as BTNH, bottom-right
causal with a bias folded into the bias) - (the forward builds, and the backward too when ``training``)
exactly when ``support.not_supported_reasons(config, Environment.sm90(), enforced_by=CUDNN)`` is empty.  Rules the library enforces on its own (the seed's policy) are not
cuDNN's business; where the graph builder itself refuses a structure cuDNN's API cannot express, the
support table must refuse it too (for any reason).
"""

from __future__ import annotations

import pytest

from cudnn_attn.core.config import StaticMask
from cudnn_attn.core.padded_call import lifted_config

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

support = pytest.importorskip("cudnn_attn.core.support")

pytestmark = pytest.mark.deviceless

BR_CAUSAL = StaticMask(right_bound=0, alignment=BOTTOM_RIGHT)

SUPPORTED = {
    "plain": config(),
    "causal-bf16-BNTH": config(mask=CAUSAL, dtype="bfloat16", layout=BNTH),
    "alibi-causal": config(mask=StaticMask(right_bound=0, alibi=True)),
    "bias-dbias-padding": config(bias=bias((1, N, T, S)), mask=PADDING),
    "dropout-window": config(dropout_rate=0.1, mask=StaticMask(right_bound=0, left_bound=32)),
    "bottom-right-causal-T<S": config(q_len=64, mask=BR_CAUSAL),
    "packed-gqa": config(packing=packed(), q_heads=8, kv_heads=2, mask=PADDING_CAUSAL),
    "paged-inference": config(training=False, paging=paged(), mask=BR_PADDING_CAUSAL),
    "mla-192-128": config(qk_dim=192, v_dim=128, scale=192 ** -0.5),
    "d256": config(d=256, mask=CAUSAL),
    "d72": config(d=72),
    "sink": config(sink=True),
    "deterministic-dbias": config(deterministic=True, bias=bias((B, N, T, S))),
    "fp8-training-d128-causal": fp8(mask=CAUSAL),
    "fp8-inference-d64": fp8(d=64, training=False),
    "score_mod-softcap": config(score_mod=SOFTCAP),
    "lifted-bottom-right-bias": config(mask=BR_CAUSAL, q_len=64, bias=bias((1, N, 64, S))),
    "lifted-bottom-right-window-bias-dropout": config(mask=StaticMask(right_bound=0, left_bound=32,
                                                                      alignment=BOTTOM_RIGHT),
                                                      bias=bias((B, 1, T, S)), dropout_rate=0.1),
    "lifted-packed-BNTH": config(packing=packed(), layout=BNTH, mask=PADDING),
}

# Rows the table should simply take from cuDNN (masks expressed inside a score_mod).
CUDNN_DECIDES = {
    "score_mod-softcap-causal": config(score_mod=SOFTCAP, mask=CAUSAL),
    "score_mod-softcap-window-bias": config(score_mod=SOFTCAP, mask=StaticMask(right_bound=0, left_bound=32),
                                            bias=bias((1, N, T, S), differentiable=False)),
    "score_mod-softcap-padding": config(score_mod=SOFTCAP, mask=PADDING),
}

UNSUPPORTED = {
    "alibi-without-causal": config(mask=StaticMask(alibi=True)),
    "bottom-right-padding-bias": config(mask=BR_PADDING_CAUSAL, q_len=64, bias=bias((1, N, 64, S))),
    "bottom-right-dropout": config(mask=BR_CAUSAL, q_len=64, dropout_rate=0.1),
    "bottom-right-alibi": config(mask=StaticMask(right_bound=0, alibi=True, alignment=BOTTOM_RIGHT)),
    "bottom-right-T>S": config(q_len=192, kv_len=128, mask=BR_CAUSAL),
    "window-T>S": config(q_len=192, kv_len=128, mask=StaticMask(right_bound=0, left_bound=32)),
    "d60-not-multiple-of-8": config(d=60),
    "d320-training": config(d=320),
    "sink-T1": config(q_len=1, sink=True, training=False),
    "fp8-training-d64": fp8(d=64),
    "fp8-training-mla": fp8(qk_dim=192, v_dim=128),
    "fp8-bias": fp8(bias=bias((1, N, T, S)), training=False),
    "fp8-bottom-right": fp8(mask=BR_CAUSAL, training=False),
    "fp8-training-packed": fp8(packing=packed(), mask=PADDING_CAUSAL),
    "paged-training": config(paging=paged(), mask=BR_PADDING_CAUSAL),
    "packed-bias": config(packing=packed(), mask=PADDING, bias=bias((1, N, T, S))),
    "score_mod-alibi": config(score_mod=SOFTCAP, mask=StaticMask(right_bound=0, alibi=True)),
    "score_mod-softcap-dbias": config(score_mod=SOFTCAP, bias=bias((1, N, T, S))),
}

CASES = [pytest.param(cfg, id=f"supported-{name}") for name, cfg in SUPPORTED.items()] + \
        [pytest.param(cfg, id=f"unsupported-{name}") for name, cfg in UNSUPPORTED.items()] + \
        [pytest.param(cfg, id=name) for name, cfg in CUDNN_DECIDES.items()]


def _cudnn_verdicts(deviceless, cfg):
    kinds = ("fwd", "bwd") if cfg.training else ("fwd",)
    built = lifted_config(cfg) or cfg                  # what the library hands cuDNN
    return [deviceless.verdict(built, kind) for kind in kinds]


@pytest.mark.parametrize("cfg", CASES)
def test_support_table_agrees_with_cudnn(deviceless, cfg):
    env = support.Environment.sm90(deviceless.cudnn_version)
    verdicts = _cudnn_verdicts(deviceless, cfg)
    refusals = [f"{v.refused_by}: {v.message}" for v in verdicts if not v.ok]
    if any(v.refused_by == "builder" for v in verdicts):
        reasons = support.not_supported_reasons(cfg, env)
        assert reasons, f"the graph builder refuses {cfg.describe()} but the support table accepts it:\n{refusals}"
        return
    reasons = support.not_supported_reasons(cfg, env, enforced_by=support.CUDNN)
    assert (not refusals) == (not reasons), (
        f"{cfg.describe()}\n  cuDNN: {refusals or 'builds'}\n  support table (cuDNN rules): {reasons or 'supported'}"
    )


@pytest.mark.parametrize("cfg", [pytest.param(c, id=n) for n, c in SUPPORTED.items()])
def test_supported_rows_pass_every_rule(deviceless, cfg):
    """The rows meant as supported are supported by the whole table, the library's own rules included."""
    assert support.not_supported_reasons(cfg, support.Environment.sm90(deviceless.cudnn_version)) == []
