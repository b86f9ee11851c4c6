"""The support table's rows for context parallelism: each names its feature and reason, exactly one row
fires per feature, and what runs split (causal, windows, padding, packed segments, bias, GQA, sinks) has no
reason."""

from __future__ import annotations

import pytest

from cudnn_attn.core.config import AttentionConfig, BiasSpec, DiagonalAlignment, PackingSpec, PagingSpec, StaticMask
from cudnn_attn.core.score_mod_spec import score_mod_spec
from cudnn_attn.core.support import CONTEXT_PARALLEL_RESTRICTIONS, context_parallel_reasons

BASE = AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=128, kv_len=128, qk_dim=64, v_dim=64, dtype="float16")
PADDING = StaticMask(padding=True)

REFUSED = {     # feature (the row's name) -> a configuration with it
    "dropout": BASE.replace(dropout_rate=0.1),
    "ALiBi": BASE.replace(mask=StaticMask(right_bound=0, alibi=True)),
    "FP8": BASE.replace(dtype="float8_e4m3fn", qk_dim=128, v_dim=128),
    "score_mod": BASE.replace(score_mod=score_mod_spec(lambda score: score * 0.5, (2, 4, 128, 128))),
    "packed segments in a sliding window or an off-diagonal band":
        BASE.replace(packing=PackingSpec(max_segments=2), mask=StaticMask(right_bound=0, left_bound=32, padding=True)),
    "paged K/V caches": BASE.replace(paging=PagingSpec(num_blocks_k=8, num_blocks_v=8, block_size=32,
                                                       blocks_per_seq=4), mask=PADDING),
    "a bottom-right diagonal with per-sequence lengths":
        BASE.replace(mask=StaticMask(right_bound=0, padding=True, alignment=DiagonalAlignment.BOTTOM_RIGHT)),
}
RUNS = {
    "causal": BASE.replace(mask=StaticMask(right_bound=0)),
    "window": BASE.replace(mask=StaticMask(right_bound=0, left_bound=32)),
    "padding-causal": BASE.replace(mask=StaticMask(right_bound=0, padding=True)),
    "bottom-right": BASE.replace(mask=StaticMask(right_bound=0, alignment=DiagonalAlignment.BOTTOM_RIGHT)),
    "packed": BASE.replace(packing=PackingSpec(max_segments=2), mask=PADDING),
    "packed-causal": BASE.replace(packing=PackingSpec(max_segments=2), mask=StaticMask(right_bound=0, padding=True)),
    "bias-gqa": BASE.replace(q_heads=8, kv_heads=2, bias=BiasSpec((1, 8, 128, 128), True), training=True),
    "sink-causal": BASE.replace(sink=True, mask=StaticMask(right_bound=0), training=True),
}


@pytest.mark.parametrize("feature", REFUSED, ids=list(REFUSED))
def test_each_refused_feature_has_one_row_with_its_reason(feature):
    reasons = context_parallel_reasons(REFUSED[feature])
    assert len(reasons) == 1, reasons
    assert reasons[0].startswith(f"context parallelism: not with {feature} (") and reasons[0].endswith(")"), reasons


def test_every_row_is_exercised():
    assert {rule.feature for rule in CONTEXT_PARALLEL_RESTRICTIONS} == set(REFUSED)


@pytest.mark.parametrize("config", RUNS.values(), ids=list(RUNS))
def test_what_runs_split_has_no_reason(config):
    assert context_parallel_reasons(config) == []


def test_a_malformed_question_is_a_value_error():
    with pytest.raises(ValueError, match="config: expected an AttentionConfig"):
        context_parallel_reasons("causal")
