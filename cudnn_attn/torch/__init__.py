"""cudnn_attn.torch: cuDNN attention for PyTorch (torch is an optional dependency: nothing else imports this).

* :func:`attention` - the native call on torch tensors (``mask=causal() & padding(q_lengths, kv_lengths)``,
  ``keep(bool_tensor)``; named results), differentiable with ``torch.autograd``, traceable by
  ``torch.compile(fullgraph=True)``; :func:`sdpa` - the same with the mask as plain arguments.
* ``torch.ops.cudnn_attn.attention`` / ``attention_backward`` - the custom operators underneath
  (:mod:`cudnn_attn.torch.ops`), and :class:`~cudnn_attn.torch.eager.AttentionFunction`, the same forward and
  gradient for eager autograd without torch's dispatcher (:mod:`cudnn_attn.torch.eager`).
* :func:`register_transformers` - registers the attention and its mask with Hugging Face transformers
  (``attn_implementation="cudnn_attn"``).

CUDA tensors run cuDNN on torch's current stream, zero-copy, in memory of torch's caching allocator, so torch's CUDA
graphs (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) hold them; a shape's first call must come
before a capture (:class:`CaptureWarmupError`).  CPU tensors run the NumPy reference.
"""

from .api import attention, sdpa
from .ops import CaptureWarmupError, attention_backward_op, attention_op
from .transformers_attention import register_transformers, transformers_attention

__all__ = ["CaptureWarmupError", "attention", "attention_backward_op", "attention_op", "register_transformers", "sdpa",
           "transformers_attention"]
