"""The library's two kinds of error.

* Invalid input raises the built-in :class:`ValueError`, naming the argument, showing shapes/dtypes
  and stating the rule (see :mod:`cudnn_attn.core.validation`).
* A valid call that this GPU / cuDNN / build cannot run raises :class:`UnsupportedConfigurationError`
  (a :class:`NotImplementedError`) carrying the list of ``reasons``; cuDNN's own refusals are wrapped
  in it too, together with the configuration that caused them.
"""

from __future__ import annotations

from typing import Any, Sequence


class UnsupportedConfigurationError(NotImplementedError):
    """A valid attention call that cannot run here.

    Attributes:
        reasons: human-readable reasons, one per unmet requirement.
        config: the :class:`~cudnn_attn.core.config.AttentionConfig` (or ``None``).
        environment: the :class:`~cudnn_attn.core.support.Environment` that was checked (or ``None``).
        cudnn_message: cuDNN's own message when cuDNN refused the graph.
    """

    def __init__(
        self,
        reasons: Sequence[str],
        config: Any = None,
        environment: Any = None,
        cudnn_message: str | None = None,
    ):
        self.reasons = list(reasons)
        self.config = config
        self.environment = environment
        self.cudnn_message = cudnn_message
        lines = ["attention configuration not supported here:"]
        lines += [f"  - {r}" for r in self.reasons]
        if config is not None:
            lines.append(f"  configuration: {config.describe() if hasattr(config, 'describe') else config}")
        if environment is not None:
            lines.append(f"  environment: {environment}")
        if cudnn_message:
            lines.append(f"  cuDNN said: {cudnn_message.strip()}")
        super().__init__("\n".join(lines))


class NoGPUError(RuntimeError):
    """The cuDNN path was asked for on a machine without a usable CUDA GPU / cuDNN."""
