"""``branch(x) + shortcut(x)``: a residual block written for streaming.

Any residual block streams as its library writes it (torch.fx reads its ``forward``);
this one remains for trunks written for memconv 0.1.
"""

from __future__ import annotations

from torch import nn


class Residual(nn.Module):
    """``branch(x) + shortcut(x)``: a residual block whose branches are both local.

    Args:
        branch: the main branch (e.g. conv–BN–ReLU–conv–BN).
        shortcut: the skip branch; ``None`` means the identity.

    Raises:
        NotStreamableError (when streamed): if the branches' outputs do not line up.
    """

    def __init__(self, branch: nn.Module, shortcut: nn.Module | None = None):
        super().__init__()
        self.branch = branch
        self.shortcut = shortcut if shortcut is not None else nn.Identity()

    def forward(self, x):
        return self.branch(x) + self.shortcut(x)


__all__ = ["Residual"]
