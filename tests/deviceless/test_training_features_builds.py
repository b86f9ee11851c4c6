"""The graphs of the max logit (cuDNN's ``score_max`` output) and of dropout from device seed/offset tensors
build sm90 backend plans with cuDNN 9.19 (deviceless)."""

from __future__ import annotations

import pytest

from cudnn_attn.core.config import StaticMask
from cudnn_attn.graphs import TensorId

from .matrix import BR_PADDING_CAUSAL, CAUSAL, PADDING, PADDING_CAUSAL, SOFTCAP, N, S, T, bias, config, paged

pytestmark = pytest.mark.deviceless

SCORE_MAX = {
    "plain": config(score_max=True),
    "inference": config(score_max=True, training=False),
    "causal-gqa": config(score_max=True, mask=CAUSAL, q_heads=8, kv_heads=2),
    "padding-causal": config(score_max=True, mask=PADDING_CAUSAL),
    "bias-window": config(score_max=True, bias=bias((1, N, T, S)), mask=StaticMask(right_bound=0, left_bound=32)),
    "dropout": config(score_max=True, dropout_rate=0.1, mask=CAUSAL),
    "paged-decode": config(score_max=True, q_len=1, training=False, paging=paged(), mask=BR_PADDING_CAUSAL),
    "score_mod": config(score_max=True, score_mod=SOFTCAP),
}


def test_score_max_with_a_sink_is_refused_by_cudnn(deviceless):
    """The support table's "max logit" row with a sink (enforced by cuDNN) holds on sm90."""
    verdict = deviceless.verdict(config(score_max=True, sink=True, mask=CAUSAL), "fwd")
    assert not verdict.ok and verdict.refused_by == "cudnn"


@pytest.mark.parametrize("cfg", SCORE_MAX.values(), ids=SCORE_MAX.keys())
def test_score_max_is_an_extra_output_of_the_forward(deviceless, cfg):
    verdict = deviceless.verdict(cfg, "fwd")
    assert verdict.ok, f"cuDNN refused {cfg.describe()}:\n{verdict.message}"
    assert verdict.plan.startswith("eng"), verdict.plan
    assert {TensorId.SCORE_MAX.name, TensorId.SCORE_SUM_EXP.name} <= set(verdict.uids)
    assert TensorId.STATS.name not in verdict.uids


DEVICE_SEED = {
    "dropout": config(dropout_rate=0.1, device_seed=True),
    "dropout-padding-causal-gqa": config(dropout_rate=0.2, device_seed=True, mask=PADDING_CAUSAL, q_heads=8,
                                         kv_heads=2),
    "dropout-bias": config(dropout_rate=0.1, device_seed=True, bias=bias((1, N, T, S)), mask=PADDING),
}


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("cfg", DEVICE_SEED.values(), ids=DEVICE_SEED.keys())
def test_dropout_reads_its_seed_and_offset_from_device_tensors(deviceless, cfg, kind):
    verdict = deviceless.verdict(cfg, kind)
    assert verdict.ok, f"cuDNN refused {kind} {cfg.describe()}:\n{verdict.message}"
    assert verdict.plan.startswith("eng"), verdict.plan
    assert {TensorId.DEVICE_SEED.name, TensorId.DEVICE_OFFSET.name} <= set(verdict.uids)
    assert not {TensorId.SEED.name, TensorId.OFFSET.name} & set(verdict.uids)


def test_device_seed_without_dropout_is_the_plain_configuration():
    assert config(device_seed=True) == config()
