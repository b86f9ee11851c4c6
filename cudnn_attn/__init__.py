"""cudnn_attn: cuDNN fused attention from Python (CuPy / DLPack arrays and JAX).

``attention(q, k, v, mask=causal() & padding(q_lengths, kv_lengths), return_aux=AuxRequest(logsumexp=True))``
is the native call (named results); ``dot_product_attention`` / ``paged_attention`` /
``dot_product_attention_bwd`` keep the signatures of JAX's cuDNN attention.  ``MaskSpec`` is the native API's
composable mask (:mod:`cudnn_attn.masks`); the configuration's static mask fields are
:class:`cudnn_attn.config.MaskSpec`.
"""

from .config import AttentionConfig, AttentionOperands, DiagonalAlignment
from .errors import NoGPUError, UnsupportedConfigurationError
from .masks import MaskSpec, alibi, causal, keep, padding, segments, window
from .signature import AuxRequest
from .types import AttentionGrads, AttentionLayout, AttentionOutput, FP8Params, Kind, MaskType
from .api import (
    BoundAttention, attention, bind, dot_product_attention, dot_product_attention_bwd, paged_attention,
)
from .cache import GraphCache, graph_cache

__all__ = [
    "AttentionConfig", "AttentionGrads", "AttentionLayout", "AttentionOperands", "AttentionOutput", "AuxRequest",
    "BoundAttention", "DiagonalAlignment", "FP8Params", "GraphCache", "Kind", "MaskSpec", "MaskType", "NoGPUError",
    "UnsupportedConfigurationError", "alibi", "attention", "bind", "causal", "dot_product_attention",
    "dot_product_attention_bwd", "graph_cache", "keep", "padding", "paged_attention", "segments",
    "window",
]
__version__ = "0.1.0"

from . import preload as _preload

_preload.start()        # `import cudnn` on a thread while the caller sets up (cudnn_attn.preload)
