"""The public names a user reaches from ``import memconv``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memconv


def test_strategies_is_the_registry_subpackage():
    assert callable(memconv.strategies.register_strategy)
    assert isinstance(memconv.strategies.get_strategy("shift"), memconv.strategies.Strategy)
    assert memconv.available_strategies() == memconv.strategies.strategy_names()
    assert "auto" in memconv.available_strategies()


def test_save_memory_without_argument_is_auto_and_bools_follow_backpack():
    assert memconv.save_memory().settings.strategy == "auto"
    assert memconv.save_memory(True).settings.strategy == "rochette"
    assert memconv.save_memory(False).settings.strategy == "standard"


def test_layers_registry_is_public():
    assert memconv.layers.find_rule(nn.Conv2d(1, 1, 1)) is not None
    assert issubclass(memconv.layers.LayerRule, object)


def test_every_name_in_all_exists():
    for name in memconv.__all__:
        assert hasattr(memconv, name), name


def test_rmsnorm_is_exported_where_torch_has_it():
    if not hasattr(nn, "RMSNorm"):
        pytest.skip("torch < 2.4 has no nn.RMSNorm")
    assert "RMSNorm" in memconv.__all__
    model = memconv.convert(nn.Sequential(nn.Linear(3, 4), nn.RMSNorm(4)))
    assert type(model[1]) is memconv.RMSNorm
    x = torch.randn(5, 3)
    with memconv.per_sample():
        model(x).sum().backward()
    assert model[1].weight.grad_batch.shape == (5, 4)
    assert torch.allclose(model[1].weight.grad_batch.sum(0), model[1].weight.grad)
