"""memconv: exact, memory-lean backward passes for convolutions.

Swappable weight-VJP strategies for convolutions behind one context manager,
extended modules that compute per-sample gradients in their single backward pass,
and per-sample gradient extraction for whole models.

Example:
    >>> import memconv
    >>> model = memconv.convert(model)
    >>> with memconv.save_memory("streaming", tile_size=16), memconv.per_sample():
    ...     loss_fn(model(x), y).backward()
    >>> model[0].weight.grad_batch.shape    # [N, C_out, C_in/G, k, k]
"""

from . import layers, modules, reversible, strategies
from ._version import __version__ as __version__
from .conv.grads import bias_grad
from .conv.memory import predict_memory
from .conv.settings import available_strategies, current_strategy, per_sample, save_memory
from .conv.vjp import weight_vjp
from .engine.planning import Plan, plan
from .modules import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Embedding,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    Linear,
    PReLU,
    convert,
)
from .tasks import groups
from .tasks.adaptive import AdaptiveClipping
from .tasks.clipping import clip_and_accumulate
from .tasks.grads import per_sample_grads
from .tasks.norms import per_sample_norms
from .tasks.recorded import clipping, recording
from .tasks.step import PrivateStep

__all__ = [
    "AdaptiveClipping",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Embedding",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LayerNorm",
    "Linear",
    "PReLU",
    "Plan",
    "PrivateStep",
    "available_strategies",
    "bias_grad",
    "clip_and_accumulate",
    "clipping",
    "convert",
    "current_strategy",
    "per_sample",
    "per_sample_grads",
    "per_sample_norms",
    "plan",
    "predict_memory",
    "recording",
    "save_memory",
    "groups",
    "layers",
    "reversible",
    "strategies",
    "weight_vjp",
]

if hasattr(modules, "RMSNorm"):  # torch >= 2.4
    from .modules import RMSNorm  # noqa: F401

    __all__.append("RMSNorm")
