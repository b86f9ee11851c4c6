"""cudnn_attn: cuDNN fused attention from Python (CuPy / DLPack arrays and JAX)."""

from .config import AttentionConfig, AttentionOperands, DiagonalAlignment, MaskSpec
from .errors import NoGPUError, UnsupportedConfigurationError
from .types import AttentionGrads, AttentionLayout, AttentionOutput, FP8Params, MaskType

__all__ = [
    "AttentionConfig", "AttentionGrads", "AttentionLayout", "AttentionOperands", "AttentionOutput",
    "DiagonalAlignment", "FP8Params", "MaskSpec", "MaskType", "NoGPUError", "UnsupportedConfigurationError",
]
__version__ = "0.1.0"
