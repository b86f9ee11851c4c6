"""A recording dispatch mode for the torch front's tests (imported after ``pytest.importorskip("torch")``)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


def names_mode() -> TorchDispatchMode:
    """A dispatch mode that records the name of every operator it sees (``mode.names``)."""
    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    return Names()
