"""memconv.conv.contract: torch.einsum's numbers eagerly and in a traced graph, where it
is a product and a sum (a fusable reduction) instead of a batched matrix product."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from memconv.conv.contract import contract

#: (equation, shape of a, shape of b): the forms memconv's routes contract.
CASES = [
    ("na,na->n", (5, 7), (5, 7)),  # a per-sample squared norm
    ("nabcd,nabcd->n", (4, 3, 2, 1, 1), (4, 3, 2, 1, 1)),
    ("nck,ck->nc", (3, 4, 5), (4, 5)),  # weight standardisation's <g_c, w_c>
    ("ck,nck->nc", (4, 5), (3, 4, 5)),
    ("nc...,nc...->nc", (3, 4, 2, 2), (3, 4, 2, 2)),  # per-channel sums of g·x̂
    ("ngot,ngt->ngo", (3, 2, 4, 5), (3, 2, 5)),
    ("n,n...->...", (3,), (3, 4, 5, 1)),  # the clipped sum Σ c_n g_n
    ("n,n...->...", (3,), (3,)),
    ("n,n...->...", (3,), (3, 1, 6)),
    ("abc,abc->acb", (2, 3, 4), (2, 3, 4)),  # an output in another order
    ("nck,nck->nck", (2, 3, 4), (2, 3, 4)),  # nothing summed
]


def _operands(a_shape, b_shape):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(a_shape, generator=g, dtype=torch.float64),
        torch.randn(b_shape, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("equation,a_shape,b_shape", CASES)
def test_contract_is_einsum_eagerly_and_traced(equation, a_shape, b_shape):
    a, b = _operands(a_shape, b_shape)
    want = torch.einsum(equation, a, b)
    eager = contract(equation, a, b)
    assert eager.shape == want.shape and torch.equal(eager, want)
    graph = make_fx(lambda x, y: contract(equation, x, y))(a, b)
    traced = graph(a, b)
    assert traced.shape == want.shape
    torch.testing.assert_close(traced, want, rtol=1e-12, atol=1e-12)
    targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert not targets & {aten.bmm.default, aten.mm.default, aten.mv.default}, targets
    assert aten.mul.Tensor in targets


@pytest.mark.parametrize(
    "equation,why",
    [
        ("ngcs,ngcu->ngsu", "matrix product"),  # a Gram matrix: einsum's own
        ("nn,n->n", "each once"),
        ("na,na,na->n", "two operands"),
        ("na,na", "two operands"),
    ],
)
def test_contract_refuses_what_it_does_not_compute(equation, why):
    a = torch.ones(2, 2, 2, 2)
    with pytest.raises(ValueError, match=why):
        contract(equation, a, a)
