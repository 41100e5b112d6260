"""Kronecker-factored extensions (KFAC, KFLR, KFRA) for convolutions.

Placeholder: memconv supplies no module extension of its own for them yet, so
:func:`memconv.integrations.backpack.install` keeps BackPACK's.
"""

from __future__ import annotations


def module_extension(ext, module_class):
    """memconv's module extension of a KFAC, KFLR or KFRA object for a convolution
    class, or None where BackPACK's own is kept."""
    return None
