"""cudnn_attn: cuDNN fused attention from Python (CuPy / DLPack arrays and JAX)."""

from .config import AttentionConfig, AttentionOperands, DiagonalAlignment, MaskSpec
from .errors import NoGPUError, UnsupportedConfigurationError
from .types import AttentionGrads, AttentionLayout, AttentionOutput, FP8Params, Kind, MaskType
from .api import BoundAttention, bind, dot_product_attention, dot_product_attention_bwd, paged_attention
from .cache import GraphCache, graph_cache

__all__ = [
    "AttentionConfig", "AttentionGrads", "AttentionLayout", "AttentionOperands", "AttentionOutput", "BoundAttention",
    "DiagonalAlignment", "FP8Params", "GraphCache", "Kind", "MaskSpec", "MaskType", "NoGPUError",
    "UnsupportedConfigurationError", "bind", "dot_product_attention", "dot_product_attention_bwd", "graph_cache",
    "paged_attention",
]
__version__ = "0.1.0"
