"""cudnn_attn: cuDNN fused attention from Python (CuPy / DLPack arrays and JAX).

``attention(q, k, v, mask=causal() & padding(q_lengths, kv_lengths), return_aux=AuxRequest(logsumexp=True))``
is the native call (named results); ``dot_product_attention`` / ``paged_attention`` /
``dot_product_attention_bwd`` keep the signatures of JAX's cuDNN attention.  ``MaskSpec`` is the native API's
composable mask (:mod:`cudnn_attn.core.masks`).
"""

from cudnn_attn.tracing import score_mod as _score_mod_tracer  # noqa: F401 -- installs the score_mod tracer
from cudnn_attn.core.config import AttentionConfig, AttentionOperands, DiagonalAlignment
from cudnn_attn.core.diagonal_warning import TopLeftCausalWarning
from cudnn_attn.core.environment import VERSION
from cudnn_attn.core.errors import NoGPUError, UnsupportedConfigurationError
from cudnn_attn.core.masks import MaskSpec, alibi, causal, keep, padding, segments, window
from cudnn_attn.core.parameters import AuxRequest
from cudnn_attn.core.types import AttentionGrads, AttentionLayout, AttentionOutput, FP8Params, Kind, MaskType
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine.cache import GraphCache, graph_cache
from cudnn_attn.engine.runtime import is_gpu_available
from cudnn_attn.fronts.cupy import (
    BoundAttention,
    attention,
    bind,
    dot_product_attention,
    dot_product_attention_bwd,
    paged_attention,
)

__all__ = [
    "AttentionConfig", "AttentionGrads", "AttentionLayout", "AttentionOperands", "AttentionOutput", "AuxRequest",
    "BoundAttention", "DiagonalAlignment", "FP8Params", "GraphCache", "Kind", "MaskSpec", "MaskType", "NoGPUError",
    "TopLeftCausalWarning", "UnsupportedConfigurationError", "alibi", "attention", "bind", "causal",
    "dot_product_attention", "dot_product_attention_bwd", "graph_cache", "is_gpu_available", "keep", "padding",
    "paged_attention", "segments", "validate_call", "window",
]
__version__ = VERSION


def __getattr__(name: str):
    """``cudnn_attn.reference`` (the NumPy reference) on first use: ``import cudnn_attn`` does not import it."""
    if name == "reference":
        import cudnn_attn.reference as reference

        return reference
    raise AttributeError(f"module 'cudnn_attn' has no attribute {name!r}")


from .engine import preload as _preload

_preload.start()        # `import cudnn` on a thread while the caller sets up (cudnn_attn.engine.preload)
