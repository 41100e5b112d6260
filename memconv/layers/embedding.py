"""``Embedding`` (a module, or ``F.embedding``): per-sample gradients by scattering the output gradient into rows.

Squared norms without the ``[N, V, D]`` per-sample gradients: ghost norms over the
positions, ``Σ_{t,t'} [i_t = i_t'] g_t·g_t'`` (Li et al. 2022), whose memory is
``N·L²`` instead of ``N·V·D``. ``scale_grad_by_freq`` counts the indices of the whole
batch (it mixes the samples) and is rejected; ``padding_idx`` rows get no gradient,
as in torch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerRule, register
from .operations import BoundOp, bind_args, new_layer, register_op, with_params


def _rows(module, idx, g):
    """``(idx [N, L], g [N, L, D])`` with the padding positions' gradients zeroed."""
    n = idx.shape[0]
    idx = idx.reshape(n, math.prod(idx.shape[1:]))  # explicit: L may be 0
    g = g.reshape(n, idx.shape[1], module.embedding_dim)
    if module.padding_idx is not None:
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return idx, g


@register(nn.Embedding)
class EmbeddingRule(LayerRule):
    movable_batch_axis = True

    def check(self, module, name):
        if module.scale_grad_by_freq:
            raise ValueError(
                f"layer {name!r} (Embedding with scale_grad_by_freq=True) scales gradients "
                "by the index counts of the whole batch, so it mixes the samples; set "
                "scale_grad_by_freq=False"
            )

    def grad_sample(self, module, inputs, grad_output):
        if not module.weight.requires_grad:
            return {}
        idx, g = _rows(module, inputs[0], grad_output)
        n, vocab = idx.shape[0], module.num_embeddings
        out = g.new_zeros(n * vocab, g.shape[-1])
        offsets = (torch.arange(n, device=idx.device) * vocab).unsqueeze(1)
        out.index_add_(0, (idx + offsets).reshape(-1), g.flatten(0, 1))
        return {"weight": out.reshape(n, vocab, g.shape[-1])}

    def sq_norms(self, module, inputs, grad_output):
        if not module.weight.requires_grad:
            return {}
        idx, g = _rows(module, inputs[0], grad_output)
        same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(g.dtype)  # [N, L, L]
        return {"weight": (same * (g @ g.transpose(1, 2))).sum((1, 2))}

    def summed_grad(self, module, inputs, grad_output):
        if not module.weight.requires_grad:
            return {}
        idx, g = _rows(module, inputs[0], grad_output)
        out = g.new_zeros(module.num_embeddings, g.shape[-1])
        out.index_add_(0, idx.reshape(-1), g.flatten(0, 1))
        return {"weight": out}

    def memory(self, module, input_shapes, itemsize, task):
        n = input_shapes[0][0]
        length = 1
        for s in input_shapes[0][1:]:
            length *= s
        if task == "norms":
            return 2 * n * length * length * itemsize
        return n * module.weight.numel() * itemsize


_EMBEDDING_ARGS = (
    "input",
    "weight",
    "padding_idx",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "sparse",
)
_EMBEDDING_DEFAULTS = {
    "padding_idx": None,
    "max_norm": None,
    "norm_type": 2.0,
    "scale_grad_by_freq": False,
    "sparse": False,
}


@register_op(F.embedding)
def bind_embedding(args, kwargs) -> BoundOp | None:
    """``F.embedding`` without ``max_norm`` (which renormalises the weight in place) and
    ``scale_grad_by_freq`` (which mixes the samples)."""
    a = bind_args(_EMBEDDING_ARGS, args, kwargs, _EMBEDDING_DEFAULTS, ("input", "weight"))
    if a is None or a["max_norm"] is not None or a["scale_grad_by_freq"]:
        return None
    w = a["weight"]
    if w.dim() != 2:
        return None

    def shell(params):
        layer = new_layer(nn.Embedding, w.shape[0], w.shape[1], padding_idx=a["padding_idx"])
        return with_params(layer, params)

    return BoundOp(a["input"], {"weight": w}, shell)
