"""NumPy float64 reference of cuDNN fused attention: the test oracle and the CPU backend.

* :func:`forward` / :func:`backward` take the ``(AttentionConfig, AttentionOperands)`` pair built by
  :func:`cudnn_attn.core.validation.validate_call` and return :class:`~cudnn_attn.core.types.AttentionOutput` /
  :class:`~cudnn_attn.core.types.AttentionGrads` (formulas in :mod:`.core` and :mod:`.fp8`).
* :func:`dot_product_attention`, :func:`paged_attention`, :func:`dot_product_attention_bwd` are the
  seed-compatible entry points on NumPy arrays; :func:`attention` the native one (named results).

What it runs is the support table's to say (:mod:`cudnn_attn.core.support`, the one authority on
"unsupported").  :func:`forward` and :func:`backward` refuse only the rows no front runs (``not_supported_reasons(config,
front="reference")``, raised by :func:`~cudnn_attn.core.support.check_everywhere`): they run everything a GPU
runs and more (a training head dim of 320, FP8 with padding), the exact oracle of the tests.  The public
functions refuse in addition what the CuPy front would refuse on the CPU fronts' GPU target
(:mod:`cudnn_attn.core.cpu_target`: sm90 unless ``$CUDNN_ATTN_CPU_TARGET`` names another, ``off`` for none).

Everything is computed in float64 and rounded once, at the end, to the io dtype (logsumexp: float32).
Modules: :mod:`.tensors` (layouts, pages, dtypes), :mod:`.segments` (padding and packed sequences),
:mod:`.masks` (admissible keys, ALiBi, dropout), :mod:`.problem` (scores and softmax shared by every
path), :mod:`.core` (fp16/bf16), :mod:`.fp8` (FP8 emulation), :mod:`.seed_api`.
"""

from .core import backward, forward
from .masks import alibi_slopes
from .seed_api import attention, dot_product_attention, dot_product_attention_bwd, paged_attention

__all__ = ["alibi_slopes", "attention", "backward", "dot_product_attention", "dot_product_attention_bwd", "forward",
           "paged_attention"]
