"""cuDNN frontend graph builders (installed as ``cudnn_attn.graphs``)."""
