"""cuDNN 9.19 builds an sm90 plan for every block kernel that context parallelism calls (deviceless).

The block plans are static (``jax_bridge.sequence_plan``), so every configuration a split call will build
is known in advance (:func:`~cudnn_attn.jax_bridge.context_parallel.block_configs`): top-left bands with
``right_bound > 0``, windows sliced to the rows and keys they keep (padded when T > S), a bias by block,
per-sequence lengths, packed segments (full blocks with no band, top-left causal blocks starting on the
diagonal, bottom-right causal blocks ending on it), and a sink's call (its blocks run without the sink).  Each is built forward and backward.
"""

from __future__ import annotations

import pytest

from cudnn_attn.core.config import StaticMask
from cudnn_attn.jax_bridge.context_parallel import Scheme, Split, block_configs

from .matrix import CAUSAL, PADDING, PADDING_CAUSAL, N, S, T, bias, config, packed

pytestmark = pytest.mark.deviceless

def _splits(shards: int, balance: int) -> list[Split]:
    return [Split(("sp",), shards, balance, scheme) for scheme in Scheme]


CALLS = [   # (name, call, splits): every block shape of each mask kind, kept small for CI
    ("causal", config(mask=CAUSAL, dtype="bfloat16"), _splits(2, 0) + _splits(2, 2)),
    ("causal-bias", config(mask=CAUSAL, bias=bias((1, N, T, S))), _splits(2, 0)),
    ("window-40", config(mask=StaticMask(right_bound=0, left_bound=40)), _splits(4, 4)),
    ("padding-causal-gqa", config(mask=PADDING_CAUSAL, q_heads=8, kv_heads=2), _splits(2, 2)),
    ("packed-causal", config(mask=PADDING_CAUSAL, packing=packed(), dtype="bfloat16"), _splits(2, 0) + _splits(2, 2)),
    ("packed", config(mask=PADDING, packing=packed()), _splits(2, 2)),
    ("causal-sink", config(mask=CAUSAL, sink=True, dtype="bfloat16"), _splits(2, 2)),   # blocks without the sink
]


def _cases():
    seen = {}
    for name, cfg, splits in CALLS:
        for split in splits:
            for block in sorted(block_configs(cfg, split), key=repr):   # a set: one order in every process
                seen.setdefault(block, f"{name}-{block.q_len}x{block.kv_len}-{block.mask.describe()}")
    return [pytest.param(block, kind, id=f"{label}-{kind}") for block, label in seen.items() for kind in ("fwd", "bwd")]


@pytest.mark.parametrize("block, kind", _cases())
def test_cudnn_builds_every_context_parallel_block(deviceless, block, kind):
    verdict = deviceless.verdict(block, kind)
    assert verdict.ok, f"cuDNN refused {kind} {block.describe()}:\n{verdict.message}"
