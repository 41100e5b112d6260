"""Opacus integration: private training with memconv's clipped sum, and memconv's
per-sample samplers in Opacus' registries.

Two paths. :func:`make_private` (and :func:`make_private_with_epsilon`) returns what
Opacus' ``PrivacyEngine.make_private`` returns, keeping Opacus' accountant, noise,
Poisson sampling, DP optimizer and ``DPDDP``, with the clipped sum (flat, per-layer or
adaptive clipping) computed by
:func:`memconv.clip_and_accumulate` rather than by module hooks: any model memconv's
functions handle trains (in-place activations and adds, norm + activation layers,
subclasses with their own forward, attention); :func:`fix` turns BatchNorm layers,
subclasses included, into GroupNorm and the same activation. :func:`install` keeps
Opacus' own hooks (and its per-layer and adaptive clipping), with memconv's samplers:

memconv plugs in where Opacus itself looks up how to treat a layer: its registries of
*grad samplers* (``GRAD_SAMPLERS``, the dictionary Opacus' ``register_grad_sampler``
fills; used by ``GradSampleModule``, ``grad_sample_mode="hooks"``, and by
``"ghost"`` for layers without a norm sampler) and of *norm samplers*
(``NORM_SAMPLERS``, filled by ``register_norm_sampler``; used by
``GradSampleModuleFastGradientClipping``, ``grad_sample_mode="ghost"``). Installing
and restoring are explicit::

    import memconv
    from opacus import PrivacyEngine
    from memconv.integrations import opacus as mo

    mo.install()                              # before make_private wraps the model
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="hooks",
    )
    for x, y in loader:
        optimizer.zero_grad()
        with memconv.save_memory("shift"):    # the block around backward() applies
            criterion(model(x), y).backward() # p.grad_sample by memconv's strategy
        optimizer.step()
    mo.uninstall()                            # Opacus' own registries, exactly

or ``with mo.installed(): ...``. What :func:`install` registers:

- **grad samplers** (:func:`grad_sampler`) for every layer class with a memconv rule
  (:func:`classes`: the registry of :mod:`memconv.layers` — torch's and memconv's
  convolutions and transposed convolutions, Linear, the normalisation layers,
  Embedding, PReLU, and any rule a user registered): the per-sample gradients come
  from the layer's rule, with the strategy of the :class:`memconv.save_memory` block
  open when Opacus calls the sampler (Opacus computes per-sample gradients in a
  backward hook, so: the block around ``loss.backward()``; ``"auto"`` outside any).
  This is the one place where the block around the backward pass applies, because
  Opacus, not memconv, decides when the sampler runs; on a GPU, autograd may run
  backward hooks on its device thread, which sees no block of the calling thread,
  and the sampler then uses ``"auto"``. Exact for every ``padding_mode``: Opacus
  1.6's own convolution sampler unfolds the input with zero padding whatever the
  ``padding_mode``, so its per-sample weight gradients (and, in ghost mode, the
  norms made from them) of ``"reflect"``, ``"replicate"`` and ``"circular"``
  convolutions are silently wrong;
- **norm samplers** (:func:`norm_sampler`) for the same classes: Opacus 1.6's ghost
  clipping has norm samplers for ``Linear`` and ``Embedding`` only, so it
  instantiates a convolution's per-sample gradients to take their norms. With the
  bridge the norms come from the rules' ``sq_norms``: for convolutions Gram matrices
  per group (ghost norms: Goodfellow 2015; Li et al. 2022; Bu et al. 2022), or the
  per-sample gradients of a bounded chunk of samples, whichever the cost models
  find faster within the block's ``memory_budget`` (32 MiB without one). As Opacus'
  own norm samplers, they return norms, not squared norms.

Layers without a rule (``MultiheadAttention``, ``GRU``, ...) keep Opacus' own
treatment (its samplers, or its ``torch.func`` fallback).

Opacus' conventions are kept: the backprops it passes are already scaled for its
``loss_reduction`` (times the batch size for ``"mean"``), so ``p.grad_sample[n]`` is
the gradient of sample n's loss; results are keyed by parameter; per-sample
gradients are in the output gradient's dtype (as Opacus'), norms in float32 or wider.

Not covered: layer classes registered with memconv after :func:`install` (install
again after uninstalling), and ``grad_sample_mode="functorch"``/``"ew"``, which do
not read the registries. As for
Opacus' ``Linear``, ghost clipping then rejects a convolution called twice in one
forward pass (tied weights); ``"hooks"`` handles it. On CUDA, autograd runs
backward hooks on its own threads, where a ``save_memory`` block of the calling
thread is not visible: the samplers then use ``"auto"`` (the results are the same;
only time and memory differ).

The package, one file per concern: :mod:`~memconv.integrations.opacus.samplers` (the
bridge into Opacus' registries), :mod:`~memconv.integrations.opacus.arguments`
(``make_private``'s arguments checked and translated),
:mod:`~memconv.integrations.opacus.private_module` (:class:`PrivateModule` and its
clipping step), :mod:`~memconv.integrations.opacus.adaptive` (adaptive clipping's state
and optimizer), :mod:`~memconv.integrations.opacus.privacy_engine` (:func:`make_private`,
:func:`make_private_with_epsilon`), :mod:`~memconv.integrations.opacus.batch_norm`
(:func:`fix`) and :mod:`~memconv.integrations.opacus.fixed_size`
(:class:`FixedSizePoissonLoader`: Poisson batches padded to a fixed size, with the
mask of their real samples). It does not import Opacus until a function is called; without it,
:func:`install` raises an ``ImportError`` naming the extra to install.
"""

from __future__ import annotations

from .arguments import ADAPTIVE_ARGS, CLIPPINGS
from .batch_norm import fix
from .fixed_size import FixedSizePoissonLoader
from .privacy_engine import make_private, make_private_with_epsilon
from .private_module import PrivateModule
from .samplers import (
    classes,
    grad_sampler,
    install,
    installed,
    is_installed,
    norm_sampler,
    uninstall,
)

__all__ = [
    "ADAPTIVE_ARGS",
    "CLIPPINGS",
    "FixedSizePoissonLoader",
    "PrivateModule",
    "classes",
    "fix",
    "grad_sampler",
    "install",
    "installed",
    "is_installed",
    "make_private",
    "make_private_with_epsilon",
    "norm_sampler",
    "uninstall",
]
