"""Poisson batches padded to a fixed size, with the mask of their real samples
(masked DP-SGD: Beltran et al. 2024, "Towards Efficient and Scalable Training of
Differentially Private Deep Learning")."""

from __future__ import annotations

import torch
from torch import Tensor

from ..._checks import check_positive_int


class FixedSizePoissonLoader:
    """Opacus' Poisson batches padded to a fixed physical size: yields ``(*batch,
    sample_mask)``, each tensor of the batch with ``batch_size`` rows (its real samples
    first, then zeros) and ``sample_mask`` a ``torch.bool`` tensor ``[batch_size]``,
    True for the real samples.

    Poisson sampling (each sample drawn with probability q, independently) gives
    batches of varying size, so a compiled model recompiles for each new size; padded
    to a fixed size with a mask, every step has one shape (masked DP-SGD, Beltran et al.
    2024). Pass the mask to the private module, whose backward pass adds exactly the
    real samples' clipped sum to ``.grad``::

        model, optimizer, loader = mo.make_private(PrivacyEngine(), module=model, ...)
        for x, y, mask in mo.FixedSizePoissonLoader(loader, batch_size=256):
            optimizer.zero_grad()
            criterion(model(x, sample_mask=mask), y).backward()
            optimizer.step()

    The privacy accounting does not change: the batches are those of ``data_loader``
    (the same sampler, the same random numbers), padding only adds zeros that add
    nothing, and :func:`len` is ``data_loader``'s, so the sampling rate
    ``1/len(data_loader)`` that ``make_private`` gave the accountant stays the same.
    Nothing is dropped: a batch larger than ``batch_size`` (rare when ``batch_size`` is
    a few standard deviations ``√(q·(1-q)·|D|)`` above the expected size ``q·|D|``) is
    padded to the smallest multiple of ``batch_size`` that holds it, a shape of its
    own (counted in :attr:`oversized`). An empty batch is ``batch_size`` rows of
    padding, all masked out.

    Args:
        data_loader: Opacus' ``DPDataLoader`` (the loader ``make_private`` returns
            with ``poisson_sampling=True``), whose batches are tuples or lists of
            tensors ``[n, ...]``.
        batch_size: the physical batch size (positive int).

    Attributes:
        data_loader: as given.
        batch_size: as given.
        oversized: how many batches so far were larger than ``batch_size``.

    Raises:
        TypeError: ``data_loader`` not an Opacus ``DPDataLoader``; ``batch_size`` not
            an int. At iteration, a batch that is not a tuple or list of tensors of
            one length.
        ValueError: ``batch_size`` not positive.
    """

    def __init__(self, data_loader, batch_size: int):
        from opacus.data_loader import DPDataLoader

        if not isinstance(data_loader, DPDataLoader):
            raise TypeError(
                "data_loader must be Opacus' DPDataLoader (the loader make_private returns "
                "with poisson_sampling=True, or DPDataLoader.from_data_loader(loader)), got "
                f"{type(data_loader).__name__}"
            )
        check_positive_int(batch_size, "batch_size", none=False)
        self.data_loader = data_loader
        self.batch_size = batch_size
        self.oversized = 0

    @property
    def dataset(self):
        """The data set of ``data_loader``."""
        return self.data_loader.dataset

    @property
    def sample_rate(self) -> float:
        """The Poisson sampling rate q of ``data_loader``: ``1/len(data_loader)``."""
        return 1 / len(self.data_loader)

    def __len__(self) -> int:
        return len(self.data_loader)

    def __iter__(self):
        for batch in self.data_loader:
            yield self.pad(batch)

    def pad(self, batch) -> tuple:
        """``(*batch padded, sample_mask)`` of one batch (see the class docstring).

        Raises:
            TypeError: a batch that is not a tuple or list of tensors of one length.
        """
        if not (
            isinstance(batch, (tuple, list))
            and batch
            and all(isinstance(t, Tensor) and t.dim() >= 1 for t in batch)
            and len({len(t) for t in batch}) == 1
        ):
            raise TypeError(
                "FixedSizePoissonLoader pads batches that are tuples or lists of tensors "
                "[n, ...] of one length n (as a TensorDataset's), got "
                f"{type(batch).__name__}"
            )
        n = len(batch[0])
        size = self.batch_size * max(1, -(-n // self.batch_size))
        if size > self.batch_size:
            self.oversized += 1
        padded = tuple(_pad(t, size) for t in batch)
        mask = torch.arange(size, device=batch[0].device) < n
        return (*padded, mask)


def _pad(t: Tensor, size: int) -> Tensor:
    """``t`` ``[n, ...]`` followed by zero rows up to ``size`` rows."""
    if len(t) == size:
        return t
    return torch.cat([t, t.new_zeros((size - len(t), *t.shape[1:]))])
