"""A ``torch.compile``'d model through the per-sample step: one traced graph per plan,
compiled by the model's backend, equal to the eager path in float64.

Most cases compile with ``backend="aot_eager"`` (Dynamo and AOTAutograd, no code
generation: seconds, not minutes, on two cores); the numbers of a backend are that
backend's business, the graph memconv hands it is what is tested. One small model
goes through inductor itself. The reference of every step is the eager path on the
uncompiled model (itself tested against per-sample autograd loops elsewhere), and
one case is checked against such a loop here too.
"""

import json
import logging
import warnings

import pytest
import torch
from helpers import CallCounter, loop_reference
from torch import nn
from torch._dynamo.utils import counters

import memconv
from memconv.bench import models
from memconv.bench.steps import LoraLinear

TOL = 1e-10


def _seed_cnn():
    return models.seed_cnn(side=28, in_channels=1), (1, 28, 28)


def _tiny_cnn():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 10),
    )
    return model, (1, 8, 8)


def _tv_resnet():  # in-place ReLU, ``out += identity``, GroupNorm
    model = models.TVResNet((1, 1, 1, 1), norm_layer=lambda c: nn.GroupNorm(2, c), width=4)
    return model, (3, 8, 8)


def _convnext():  # LayerNorm2d, depthwise 7×7, layer scale (gamma)
    return models.ConvNeXt((1, 1), (8, 16)), (3, 16, 16)


def _vit():  # class token, position embedding, attention
    model = models.VisionTransformer(img_size=8, patch_size=4, embed_dim=12, depth=1, num_heads=2)
    return model, (3, 8, 8)


def _nf_resnet():  # weight-standardised convolutions, skipinit gains
    return models.NormFreeNet((1, 1), skipinit=True), (3, 8, 8)


def _lora():
    torch.manual_seed(1)
    head = LoraLinear(nn.Linear(16, 10))
    head.base_layer.requires_grad_(False)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 16), head
    )
    return model, (3, 6, 6)


MODELS = {
    "seed-cnn": _seed_cnn,
    "tiny-cnn": _tiny_cnn,
    "tv-resnet": _tv_resnet,
    "convnext": _convnext,
    "vit": _vit,
    "nf-resnet": _nf_resnet,
    "lora": _lora,
}


def assert_close(got, ref, rtol):
    """Tensors, or dicts of them with the same keys, within ``rtol`` relative to the
    largest entry of the reference."""
    if isinstance(ref, dict):
        assert set(got) == set(ref)
        for k in ref:
            assert_close(got[k], ref[k], rtol)
        return
    assert got.shape == ref.shape
    scale = ref.abs().max().item() or 1.0
    assert (got - ref).abs().max().item() <= rtol * scale


def _batch(shape, n=4, seed=0, classes=10):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    return x, torch.randint(0, classes, (n,), generator=g)


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _steps(name, task, n_steps=3, backend="aot_eager", **kwargs):
    """``n_steps`` calls of ``task`` on the compiled model and on the eager one, each
    on a new batch; returns the per-step pairs and the compiled PrivateStep."""
    torch.manual_seed(0)
    model, shape = MODELS[name]()
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    compiled = memconv.PrivateStep(torch.compile(model, backend=backend), loss_fn, **kwargs)
    eager = memconv.PrivateStep(model, loss_fn, **kwargs)
    pairs = []
    for i in range(n_steps):
        x, y = _batch(shape, seed=i)
        if task == "clip":
            model.zero_grad(set_to_none=True)
            got_norms = compiled.clip_and_accumulate(x, y, max_norm=0.5)
            got = (got_norms, _grads(model))
            model.zero_grad(set_to_none=True)
            ref = (eager.clip_and_accumulate(x, y, max_norm=0.5), _grads(model))
        elif task == "norms":
            got = compiled.per_sample_norms(x, y, groups="layer")
            ref = eager.per_sample_norms(x, y, groups="layer")
        else:
            got = compiled.per_sample_grads(x, y)
            ref = eager.per_sample_grads(x, y)
        pairs.append((got, ref))
    return pairs, compiled


@pytest.mark.parametrize("name", list(MODELS))
def test_clipped_sum_of_a_compiled_model_is_the_eager_one(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step falls back to eager
        pairs, step = _steps(name, "clip", n_steps=4)
    for got, ref in pairs:
        assert_close(got[0], ref[0], TOL)
        assert_close(got[1], ref[1], TOL)
    traced = step._prepared.traced
    assert traced.traces == 1 and not traced.refused
    (graph,) = traced.graphs.values()
    assert graph.calls == 2  # steps 3 and 4: the first probes and plans, the second traces
    assert counters["aot_autograd"]["total"] == 1  # one graph, compiled once
    assert not counters["graph_break"]
    assert not counters["recompiles"]


@pytest.mark.parametrize("task", ["norms", "grads"])
@pytest.mark.parametrize("name", ["tiny-cnn", "vit"])
def test_norms_and_grads_of_a_compiled_model(name, task):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pairs, step = _steps(name, task)
    for got, ref in pairs:
        assert_close(got, ref, TOL)
    assert step._prepared.traced.traces == 1
    assert not counters["graph_break"]


def test_plain_functions_keep_the_compiled_step_per_model():
    torch.manual_seed(0)
    model, shape = _tv_resnet()
    model = model.double()
    compiled = torch.compile(model, backend="aot_eager")
    loss_fn = nn.CrossEntropyLoss()
    for i in range(3):
        x, y = _batch(shape, seed=i)
        model.zero_grad(set_to_none=True)
        memconv.clip_and_accumulate(compiled, loss_fn, x, y, max_norm=1.0)
        got = _grads(model)
        ref = loop_reference(model, loss_fn, x, y)
        norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in ref.values()))
        c = (1.0 / norms).clamp(max=1.0)
        want = {k: torch.einsum("n,n...->...", c, v) for k, v in ref.items()}
        assert_close(got, want, TOL)
    assert counters["aot_autograd"]["total"] == 1


def test_a_new_shape_or_option_traces_again_and_the_old_graph_is_kept():
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), nn.CrossEntropyLoss())
    for seed in range(3):
        step.clip_and_accumulate(*_batch(shape, seed=seed), max_norm=1.0)
    step.clip_and_accumulate(*_batch(shape, seed=3), max_norm=2.0)  # an input: the graph
    assert step._prepared.traced.traces == 1
    for seed in range(3):  # another grouping: another graph
        step.clip_and_accumulate(*_batch(shape, seed=seed), max_norm=2.0, groups="layer")
    assert step._prepared.traced.traces == 2
    x, y = _batch(shape, seed=0)
    model.zero_grad(set_to_none=True)
    got = step.clip_and_accumulate(x, y, max_norm=1.0)  # the first graph again
    assert step._prepared.traced.traces == 2
    ref = memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y)
    assert_close(got, ref, TOL)


def test_inputs_of_other_strides_trace_again():
    """The compiled code is specialised to its inputs' strides: the same shape in
    another layout (channels-last, a transposed view) gets its own graph, equal to the
    eager step, and the first graph is kept."""
    torch.manual_seed(0)
    model, _ = _tiny_cnn()
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), loss_fn)
    x, y = _batch((3, 8, 8), seed=0)
    model[0] = nn.Conv2d(3, 4, 3, padding=1).double()
    layouts = [
        x,
        x.contiguous(memory_format=torch.channels_last),
        x.transpose(2, 3).contiguous().transpose(2, 3),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for inputs in layouts:
            for _ in range(3):
                got = step.per_sample_norms(inputs, y)
            assert_close(got, memconv.per_sample_norms(model, loss_fn, x, y), TOL)
    assert step._prepared.traced.traces == 3
    assert counters["aot_autograd"]["total"] == 3


def test_targets_that_are_not_a_tensor_run_eagerly_with_a_warning():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), _ListLoss())
    x = torch.randn(4, 3, dtype=torch.float64)
    y = [0, 1, 1, 0]
    step.per_sample_norms(x, y)
    with pytest.warns(RuntimeWarning, match="targets are a list, not a tensor"):
        got = step.per_sample_norms(x, y)
    ref = memconv.per_sample_norms(model, _ListLoss(), x, y)
    assert_close(got, ref, TOL)
    assert step._prepared.traced.traces == 0


class _ListLoss(nn.Module):
    """Cross-entropy of targets given as a list of class indices."""

    def forward(self, logits, targets):
        index = torch.tensor(targets, device=logits.device)
        return nn.functional.cross_entropy(logits, index)


def test_inductor_compiles_the_step():
    """Inductor itself (code generation) on a tiny CNN: float64 equal to the eager path."""
    pairs, step = _steps("tiny-cnn", "clip", backend="inductor")
    for got, ref in pairs:
        assert_close(got[0], ref[0], 1e-9)
        assert_close(got[1], ref[1], 1e-9)
    assert step._prepared.traced.traces == 1 and not counters["graph_break"]


def _warns_and_matches_eager(model, match):
    """A compiled step of ``model`` that warns (``match``) at its second call, where it
    would trace, and keeps no graph; returns the step, its batch and the warned call's
    norms."""
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), loss_fn)
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    step.per_sample_norms(x, y)
    with pytest.warns(RuntimeWarning, match=match):
        warned = step.per_sample_norms(x, y)
    assert not step._prepared.traced.graphs
    return step, x, y, warned


class _HostRead(nn.Module):
    """A model whose forward reads a value on the host (data-dependent control flow)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if h.sum() > 0 else h


def test_a_step_that_cannot_be_traced_warns_once_and_runs_eagerly():
    torch.manual_seed(0)
    model = _HostRead().double()
    match = "runs eagerly, not compiled: the trace stopped"
    step, x, y, got = _warns_and_matches_eager(model, match)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        again = step.per_sample_norms(-x, y)
    loss_fn = nn.CrossEntropyLoss()
    assert_close(got, memconv.per_sample_norms(model, loss_fn, x, y), TOL)
    assert_close(again, memconv.per_sample_norms(model, loss_fn, -x, y), TOL)


class _HeldTensor(nn.Module):
    """A model that reads a tensor held as a plain attribute (neither a parameter nor
    a buffer): its value at the trace would be frozen into the graph."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.scale = torch.ones(2, dtype=torch.float64)

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_tensor_from_outside_the_model_is_refused_not_frozen():
    torch.manual_seed(0)
    model = _HeldTensor().double()
    step, x, y, _ = _warns_and_matches_eager(model, "neither an input nor a parameter or buffer")
    loss_fn = nn.CrossEntropyLoss()
    model.scale = torch.full((2,), 3.0, dtype=torch.float64)  # seen: the step is eager
    got = step.per_sample_norms(x, y)
    assert_close(got, memconv.per_sample_norms(model, loss_fn, x, y), TOL)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_parameters_updated_in_place_are_read_by_the_compiled_graph(backend):
    """The backend takes the traced graph directly (no Dynamo): the model's parameters
    are the graph's inputs, read at each call, never constants folded into its code."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(torch.compile(model, backend=backend), loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _batch(shape)
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        got = step.clip_and_accumulate(x, y, max_norm=1.0)
        opt.step()
    assert step._prepared.traced.traces == 1
    model.zero_grad(set_to_none=True)
    ref = memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=1.0)
    opt.zero_grad(set_to_none=True)
    assert_close(step.clip_and_accumulate(x, y, max_norm=1.0), ref, TOL)
    assert not torch.equal(got, ref)  # the parameters moved


def test_non_finite_norm_of_a_compiled_step_raises_before_grad():
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), nn.CrossEntropyLoss())
    for seed in range(3):
        step.clip_and_accumulate(*_batch(shape, seed=seed), max_norm=1.0)
    model.zero_grad(set_to_none=True)
    x, y = _batch(shape, seed=5)
    x[2] = float("nan")
    with pytest.raises(RuntimeError, match="sample\\(s\\) 2 is not finite"):
        step.clip_and_accumulate(x, y, max_norm=1.0)
    assert all(p.grad is None for p in model.parameters())
    assert step._prepared.traced.traces == 1  # the compiled graph ran; the host check raised


def test_the_device_side_check_needs_no_host_read():
    from memconv.tasks.groups import assert_flag_on_device, finite_flag

    caller = "memconv.clip_and_accumulate"
    assert_flag_on_device(finite_flag([torch.ones(3), torch.zeros(0)]), caller)
    assert_flag_on_device(finite_flag([torch.zeros(0)]), caller)  # nothing to check
    with pytest.raises(RuntimeError):  # on the CPU the assertion fails at once
        assert_flag_on_device(finite_flag([torch.tensor([1.0, float("inf")])]), caller)


def test_a_compiled_step_function_breaks_its_graph_once_at_memconv():
    """``torch.compile(step_fn)`` where ``step_fn`` calls memconv: Dynamo calls memconv
    as it is (one graph break, where it would otherwise break at every piece of
    memconv's Python), and the numbers are the eager ones."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    step = memconv.PrivateStep(model, nn.CrossEntropyLoss())

    def step_fn(x, y):
        h = x * 1.0  # traced by Dynamo
        return step.per_sample_norms(h, y) + 0.0

    compiled = torch.compile(step_fn, backend="aot_eager")
    for seed in range(3):
        x, y = _batch(shape, seed=seed)
        assert_close(compiled(x, y), step.per_sample_norms(x, y), TOL)
    breaks = counters["graph_break"]
    assert sum(breaks.values()) == 1 and "disable" in next(iter(breaks))


@pytest.mark.parametrize("name", ["tv-resnet", "vit"])
def test_the_recording_block_runs_a_compiled_model_in_two_compiled_halves(name, caplog):
    caplog.set_level(logging.INFO, logger="memconv.engine.traced")
    torch.manual_seed(0)
    model, shape = MODELS[name]()
    model = model.double()
    compiled = torch.compile(model, backend="aot_eager")
    loss_fn = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step falls back to eager
        for i in range(4):
            x, y = _batch(shape, seed=i)
            model.zero_grad(set_to_none=True)
            with memconv.recording(compiled) as rec:
                loss_fn(compiled(x), y).backward()
            summed = _grads(model)
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            assert_close(summed, _grads(model), TOL)  # .grad: the ordinary gradient
            assert_close(rec.grads, memconv.per_sample_grads(model, loss_fn, x, y), TOL)
    traced = _block_traced(compiled)
    assert traced.traces == 1 and [s.calls for s in traced.splits.values()] == [2]
    assert counters["aot_autograd"]["total"] == 2 and not counters["recompiles"]
    assert not [r for r in caplog.records if "cut as traced" in r.getMessage()]  # min-cut


def _clipping_block_steps(name, n_steps=4, backend="aot_eager", **options):
    """``n_steps`` steps of ``memconv.clipping`` around the user's forward and backward
    pass of the compiled model, a new block each step, each against the eager
    ``clip_and_accumulate`` of the uncompiled model on the same batch; returns the
    pairs ``((grads, norms), (grads, norms))`` and the compiled model."""
    torch.manual_seed(0)
    model, shape = MODELS[name]()
    model = model.double()
    compiled = torch.compile(model, backend=backend)
    loss_fn = nn.CrossEntropyLoss()
    pairs = []
    for i in range(n_steps):
        x, y = _batch(shape, seed=i)
        model.zero_grad(set_to_none=True)
        with memconv.clipping(compiled, max_norm=0.5, **options) as clip:
            loss_fn(compiled(x), y).backward()
        got = (_grads(model), clip.norms)
        model.zero_grad(set_to_none=True)
        ref_norms = memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=0.5, **options)
        pairs.append((got, (_grads(model), ref_norms)))
    return pairs, compiled


def _block_traced(compiled):
    from memconv.engine.prepared import kept_for_blocks

    return kept_for_blocks(compiled).traced


@pytest.mark.parametrize("name", ["tiny-cnn", "tv-resnet", "convnext", "vit", "nf-resnet", "lora"])
def test_the_clipping_block_runs_a_compiled_model_in_two_compiled_halves(name, caplog):
    """The user's forward pass runs the traced step's forward half, compiled, and their
    ``loss.backward()`` its backward half: one trace (the second step's), parted by
    the min-cut partitioner, two graphs compiled once, the clipped sum and norms equal
    to the eager ones in float64."""
    caplog.set_level(logging.INFO, logger="memconv.engine.traced")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step falls back to eager
        pairs, compiled = _clipping_block_steps(name)
    for got, ref in pairs:
        assert_close(got[0], ref[0], TOL)
        assert_close(got[1], ref[1], TOL)
    traced = _block_traced(compiled)
    assert traced.traces == 1 and not traced.refused and not traced.graphs
    (split,) = traced.splits.values()
    assert split.calls == 2  # steps 3 and 4: the first probes and plans, the second traces
    assert counters["aot_autograd"]["total"] == 2  # the two halves, each compiled once
    assert not counters["graph_break"] and not counters["recompiles"]
    assert not [r for r in caplog.records if "cut as traced" in r.getMessage()]


@pytest.mark.parametrize("options", [{"groups": "layer"}, {"clip_route": "two-pass"}])
def test_the_compiled_clipping_block_by_group_and_in_two_passes(options):
    pairs, compiled = _clipping_block_steps("tv-resnet", **options)
    for got, ref in pairs:
        assert_close(got[0], ref[0], TOL)
        assert_close(got[1], ref[1], TOL)
    assert _block_traced(compiled).traces == 1
    assert counters["aot_autograd"]["total"] == 2


def test_inductor_compiles_the_clipping_blocks_halves():
    pairs, compiled = _clipping_block_steps("tiny-cnn", backend="inductor")
    for got, ref in pairs:
        assert_close(got[0], ref[0], 1e-9)
        assert_close(got[1], ref[1], 1e-9)
    assert next(iter(_block_traced(compiled).splits.values())).calls == 2


def test_the_compiled_clipping_block_checks_the_norms_and_serves_other_calls():
    """A real sample's NaN norm raises from the compiled halves, naming the sample,
    with ``.grad`` unchanged; a call without gradients inside the block runs the
    compiled model as it is."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    compiled = torch.compile(model, backend="aot_eager")
    loss_fn = nn.CrossEntropyLoss()
    for i in range(3):
        x, y = _batch(shape, seed=i)
        with memconv.clipping(compiled, max_norm=0.5):
            loss_fn(compiled(x), y).backward()
    model.zero_grad(set_to_none=True)
    x, y = _batch(shape, seed=7)
    with memconv.clipping(compiled, max_norm=0.5):
        with torch.no_grad():
            assert torch.equal(compiled(x), model(x))
        x[2] = float("nan")
        with pytest.raises(RuntimeError, match="sample\\(s\\) 2 is not finite"):
            loss_fn(compiled(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
    assert next(iter(_block_traced(compiled).splits.values())).calls == 2


def test_a_recorded_step_that_draws_random_numbers_warns_and_stays_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2)).double()
    compiled = torch.compile(model, backend="aot_eager")
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    with memconv.clipping(compiled, max_norm=1.0):
        nn.functional.cross_entropy(compiled(x), y).backward()
    with pytest.warns(RuntimeWarning, match="draws random numbers"):
        with memconv.clipping(compiled, max_norm=1.0):
            nn.functional.cross_entropy(compiled(x), y).backward()
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        with memconv.clipping(compiled, max_norm=1.0) as clip:
            torch.manual_seed(5)
            out = compiled(x)
            nn.functional.cross_entropy(out, y).backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the same dropout mask: the eager path recorded the user's
    ref_norms = memconv.clip_and_accumulate(model, nn.CrossEntropyLoss(), x, y, max_norm=1.0)
    assert_close(got, _grads(model), TOL)
    assert_close(clip.norms, ref_norms, TOL)
    assert not _block_traced(compiled).splits


@pytest.mark.parametrize("compiled_model", [False, True])
def test_a_step_function_compiled_around_the_clipping_block(compiled_model):
    """``torch.compile(step_fn)`` where ``step_fn`` opens the block around the user's
    forward and backward pass: the block's calls run as memconv's, outside Dynamo (a
    few graph breaks, none new after the first steps, no recompilation, no warning),
    exact; a compiled model inside keeps its compiled halves."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    run = torch.compile(model, backend="aot_eager") if compiled_model else model
    loss_fn = nn.CrossEntropyLoss()

    def step_fn(x, y):
        with memconv.clipping(run, max_norm=0.5) as clip:
            loss_fn(run(x), y).backward()
        return clip.norms

    step = torch.compile(step_fn, backend="aot_eager")
    breaks = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(5):
            x, y = _batch(shape, seed=i)
            model.zero_grad(set_to_none=True)
            norms = step(x, y)
            got = _grads(model)
            model.zero_grad(set_to_none=True)
            ref = memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=0.5)
            assert_close(got, _grads(model), TOL)
            assert_close(norms, ref, TOL)
            breaks.append(sum(counters["graph_break"].values()))
    assert breaks[-1] <= 3 and breaks[-1] == breaks[2]
    assert not counters["recompiles"]
    if compiled_model:
        assert [s.calls for s in _block_traced(run).splits.values()] == [3]


def test_a_compiler_error_in_the_blocks_halves_warns_and_runs_eagerly():
    def failing(graph, example_inputs):
        raise RuntimeError("no code for this graph")

    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    compiled = torch.compile(model, backend=failing)
    loss_fn = nn.CrossEntropyLoss()
    for i in range(4):
        x, y = _batch(shape, seed=i)
        model.zero_grad(set_to_none=True)
        if i == 2:  # the first call of the compiled forward half
            with pytest.warns(RuntimeWarning, match="the compiler failed: RuntimeError: no code"):
                with memconv.clipping(compiled, max_norm=0.5) as clip:
                    loss_fn(compiled(x), y).backward()
        else:
            with memconv.clipping(compiled, max_norm=0.5) as clip:
                loss_fn(compiled(x), y).backward()
        got = _grads(model)
        model.zero_grad(set_to_none=True)
        ref = memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=0.5)
        assert_close(got, _grads(model), TOL)
        assert_close(clip.norms, ref, TOL)
    assert not _block_traced(compiled).splits


def _private_pair(noise_seed=None, **options):
    """memconv's ``make_private`` (no noise, ``options`` added; each engine's noise
    generator seeded with ``noise_seed`` where given) of a tiny CNN compiled and of an
    eager copy: ``(model, copy, input shape, (private module, optimizer) of the compiled
    one, the same of the copy)``."""
    pytest.importorskip("opacus")
    import copy

    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from memconv.integrations import opacus as mo

    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    ref = copy.deepcopy(model)
    data = TensorDataset(torch.randn(16, *shape, dtype=torch.float64), torch.zeros(16).long())

    def private(m, module):
        if noise_seed is not None:
            options["noise_generator"] = torch.Generator().manual_seed(noise_seed)
        return mo.make_private(
            PrivacyEngine(),
            module=module,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=4),
            noise_multiplier=0.0,
            max_grad_norm=0.3,
            poisson_sampling=False,
            **options,
        )[:2]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG notice
        compiled = private(model, torch.compile(model, backend="aot_eager"))
        eager = private(ref, ref)
    return model, ref, shape, compiled, eager


def test_make_private_keeps_a_compiled_model_compiled_over_padded_poisson_batches():
    """Opacus' call on a compiled model, batches of varying Poisson size padded to one
    physical size: one trace, two graphs compiled once, no recompilation; each step's
    parameters equal the eager private step's on the unpadded batch."""
    model, ref, shape, (pm, opt), (rm, ropt) = _private_pair()
    g = torch.Generator().manual_seed(1)
    loss_fn = nn.CrossEntropyLoss()
    for i, real in enumerate([5, 2, 7, 4, 6]):
        x, y = _batch(shape, n=8, seed=i)
        mask = torch.zeros(8, dtype=torch.bool)
        mask[torch.randperm(8, generator=g)[:real]] = True
        x[~mask] = float("nan")  # padding: never read
        opt.zero_grad()
        loss_fn(pm(x, sample_mask=mask), torch.where(mask, y, 0)).backward()
        opt.step()
        ropt.zero_grad()
        loss_fn(rm(x[mask]), y[mask]).backward()
        ropt.step()
        assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), TOL)
        assert_close(pm.last_norms[mask], rm.last_norms, TOL)
    traced = pm._clipping._prepared.traced
    assert traced.traces == 1 and [s.calls for s in traced.splits.values()] == [3]
    assert counters["aot_autograd"]["total"] == 2 and not counters["recompiles"]


def test_adaptive_clipping_on_a_compiled_model_keeps_one_compiled_step():
    """Opacus' adaptive clipping through ``make_private`` on a compiled model: the
    threshold moves at every step (the noised count of unclipped samples), and the
    traced step takes it as an input, not a constant: one trace, its two halves
    compiled once and run from the third step on, no warning, and the same parameters
    and thresholds as the eager model's at every step."""
    adaptive = dict(
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10.0,
        min_clipbound=0.01,
        unclipped_num_std=2.0,
    )
    model, ref, shape, (pm, opt), (rm, ropt) = _private_pair(
        noise_seed=0, clipping="adaptive", **adaptive
    )
    loss_fn = nn.CrossEntropyLoss()
    counters.clear()
    thresholds = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for i in range(6):
            x, y = _batch(shape, n=8, seed=i)
            for m, o in ((pm, opt), (rm, ropt)):
                o.zero_grad()
                loss_fn(m(x), y).backward()
                o.step()
            assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), TOL)
            assert_close(pm.last_norms, rm.last_norms, TOL)
            assert opt.clipping.max_norm == pytest.approx(ropt.clipping.max_norm, rel=1e-12)
            thresholds.append(opt.clipping.max_norm)
    assert len(set(thresholds)) == 6  # a new threshold at every step
    traced = pm._clipping._prepared.traced
    assert traced.traces == 1 and [s.calls for s in traced.splits.values()] == [4]
    assert counters["aot_autograd"]["total"] == 2 and not counters["recompiles"]


def test_twenty_poisson_steps_of_a_compiled_private_model_compile_once():
    """``make_private(..., poisson_sampling=True)`` on a compiled model, its loader's
    Poisson batches padded to one size by ``FixedSizePoissonLoader``: 20 steps, one
    trace, the two halves compiled once, no recompilation."""
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from memconv.integrations import opacus as mo

    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    data = TensorDataset(torch.randn(64, *shape, dtype=torch.float64), torch.randint(0, 10, (64,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG notice
        private, optimizer, loader = mo.make_private(
            PrivacyEngine(),
            module=torch.compile(model, backend="aot_eager"),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
            data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=True,
        )
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step falls back to eager
        while steps < 20:
            for x, y, mask in mo.FixedSizePoissonLoader(loader, batch_size=24):
                optimizer.zero_grad()
                loss_fn(private(x, sample_mask=mask), y).backward()
                optimizer.step()
                steps += 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    traced = private._clipping._prepared.traced
    assert traced.traces == 1 and [s.calls for s in traced.splits.values()] == [steps - 2]
    assert counters["aot_autograd"]["total"] == 2 and not counters["recompiles"]


def _clip_checked(how, step, model, loss_fn, x, y, **options):
    """One clipping step of the compiled model of ``step`` (a :class:`memconv.PrivateStep`)
    on ``(x, y)``, by ``PrivateStep.clip_and_accumulate`` or the user's own backward
    pass in the clipping ``"block"``: its ``.grad`` and norms equal to the eager
    model's ``clip_and_accumulate`` in float64 (``model``: the compiled one's module)."""
    model.zero_grad(set_to_none=True)
    if how == "block":
        with memconv.clipping(step.model, **options) as clip:
            loss_fn(step.model(x), y).backward()
        norms = clip.norms
    else:
        norms = step.clip_and_accumulate(x, y, **options)
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    ref = memconv.clip_and_accumulate(model, loss_fn, x, y, **options)
    assert_close(got, _grads(model), TOL)
    assert_close(norms, ref, TOL)


@pytest.mark.parametrize("how", ["PrivateStep", "block"])
def test_batches_of_changing_size_run_eagerly_with_one_warning(how):
    """A compiled model given batches whose size changes from call to call: each new
    size is a new plan, which runs eagerly (no trace made for a key met once), with one
    warning naming the remedy; a size met again finds its step (kept by the plan's
    choices), traced at its second call and compiled from its third. Exact
    throughout."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    compiled = torch.compile(model, backend="aot_eager")
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(compiled, loss_fn)
    sizes = [8, 8, 8, 5, 8, 5, 8, 5, 8, 8, 8]
    warned = []
    for i, n in enumerate(sizes):
        x, y = _batch(shape, n=n, seed=i)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _clip_checked(how, step, model, loss_fn, x, y, max_norm=0.5)
        warned += [str(w.message) for w in caught if "needs a new plan" in str(w.message)]
    assert len(warned) == 1 and "sample_mask=" in warned[0]
    traced = _block_traced(compiled) if how == "block" else step._prepared.traced
    assert traced.traces == 2  # the 8s' at their second call, the 5s' at theirs
    steps = traced.splits if how == "block" else traced.graphs
    assert sorted(s.calls for s in steps.values()) == [1, 6]  # 8s from the 3rd call


def test_two_tasks_on_one_compiled_step_do_not_warn_of_a_new_plan():
    """``per_sample_grads`` and then ``clip_and_accumulate`` on one ``PrivateStep`` of a
    compiled model: the second task's first plan, after the first task's trace, is not
    a change of plan (no warning), and each task keeps its own compiled step."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    compiled = torch.compile(model.double(), backend="aot_eager")
    step = memconv.PrivateStep(compiled, nn.CrossEntropyLoss())
    x, y = _batch(shape, n=8, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # the first task traced and compiled before the second's
            step.per_sample_grads(x, y)
        for _ in range(3):
            step.clip_and_accumulate(x, y, max_norm=1.0)
        step.per_sample_grads(x, y)
    assert not [w for w in caught if "needs a new plan" in str(w.message)]
    assert sorted(g.calls for g in step._prepared.traced.graphs.values()) == [1, 2]


def test_a_step_is_cut_into_halves_that_run_its_operations_in_order():
    """``split_at_targets``: the forward half returns the output and what the backward
    half reads (an in-place change of a forward value read later included); together
    they give the whole graph's results. An output computed after the targets are
    read is refused."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from memconv.engine.traced import NotTraceable, split_at_targets

    def step(x, t, w):
        h = x @ w
        a = h.relu()
        h.mul_(2.0)  # in place, after ``a`` read ``h``
        out = a + h
        loss = (out * t).sum()
        return [loss * h.sum(), (t * a).sum(), out]

    args = (torch.randn(3, 4), torch.randn(3, 5), torch.randn(4, 5))
    graph = make_fx(step)(*args)
    for example in (None, list(args)):  # the cut as traced; the min-cut partition
        forward, backward, saved = split_at_targets(graph, example)
        output, *kept = forward(args[0], args[2])
        assert len(kept) == saved
        ref = step(*[a.clone() for a in args])
        assert torch.equal(output, ref[2])
        for got, want in zip(backward(*kept, args[1]), ref[:2]):
            assert torch.equal(got, want)

    def late(x, t, w):
        return [((x @ w) * t).sum(), (x @ w).relu()]

    with pytest.raises(NotTraceable, match="after the output gradient"):
        split_at_targets(make_fx(late)(*args))


def test_the_partitioned_halves_keep_fewer_bytes_than_the_cut():
    """With example inputs, ``split_at_targets`` parts the step as AOT Autograd parts
    a compiled training graph (min-cut): an activation's scaled copy (NF-ResNets'
    ``act(x) * beta`` before a convolution) is computed again in the backward half
    instead of being kept beside the activation; the results are the same."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from memconv.engine.traced import split_at_targets

    def step(x, t, w1, w2):
        a = (x @ w1).relu()
        b = a * 0.5
        out = b @ w2
        g_a = (t @ w2.T) * 0.5
        g_h = g_a * (a > 0)
        return [b.T @ t, x.T @ g_h, out]

    args = [torch.randn(64, 8), torch.randn(64, 16), torch.randn(8, 256), torch.randn(256, 16)]
    graph = make_fx(step)(*args)
    kept_bytes = {}
    for how, example in (("cut", None), ("min-cut", args)):
        forward, backward, saved = split_at_targets(graph, example)
        output, *kept = forward(args[0], args[2], args[3])
        kept_bytes[how] = sum(t.numel() * t.element_size() for t in kept)
        ref = step(*args)
        torch.testing.assert_close(output, ref[2], rtol=0, atol=0)
        for got, want in zip(backward(*kept, args[1]), ref[:2]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # ``b`` (float32) not kept; ``a > 0`` may be (one byte an element)
    assert kept_bytes["min-cut"] <= kept_bytes["cut"] - 64 * 256 * 3


def test_a_step_writing_to_a_buffer_is_cut_as_traced():
    """A step that writes to a buffer in place (a counter in ``forward``) is not made
    functional (the partition would drop the write, and its re-trace would write to the
    real buffer): the halves are the cut as traced, which write to it once a run."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from memconv.engine.traced import split_at_targets

    count = torch.zeros(())

    def step(x, t, w):
        count.add_(1)
        out = (x @ w).relu()
        return [(out * t).sum(), out]

    args = [torch.randn(3, 4), torch.randn(3, 5), torch.randn(4, 5)]
    graph = make_fx(step)(*args)
    assert count.item() == 1  # the trace's own call
    forward, backward, saved = split_at_targets(graph, args)
    assert count.item() == 1  # nothing ran on the real buffer
    output, *kept = forward(args[0], args[2])
    (total,) = backward(*kept, args[1])
    assert count.item() == 2
    torch.testing.assert_close(total, (output * args[1]).sum())


class _Counting(nn.Module):
    """A model that counts its calls in a buffer, as a model updating state in
    ``forward`` does (a counter, spectral norm's power iteration)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return self.fc(self.conv(x).relu().flatten(1))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("how", ["block", "PrivateStep"])
def test_a_buffer_updated_in_forward_changes_once_a_step(how, compiled):
    """memconv's own passes of the model (the probe's, the trace's) leave its buffers
    as they found them: a buffer the model updates in ``forward`` changes once per
    step, eagerly and compiled, as in the user's own training loop."""
    torch.manual_seed(0)
    model = _Counting().double()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(run, loss_fn)
    x, y = torch.randn(5, 3, 8, 8, dtype=torch.double), torch.randint(0, 3, (5,))
    for i in range(1, 5):
        if how == "block":
            with memconv.clipping(run, max_norm=1.0):
                loss_fn(run(x), y).backward()
        else:
            step.clip_and_accumulate(x, y, max_norm=1.0)
        assert model.count.item() == i


def test_padded_poisson_batches_keep_one_compiled_graph(frozen_clock):
    """Masked DP-SGD: Poisson batches of varying size padded to one physical size keep
    one traced graph (the mask is one of its inputs), and each step's clipped sum is
    the unpadded batch's."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), loss_fn)
    g = torch.Generator().manual_seed(3)
    for i, real in enumerate([5, 2, 7, 4, 6, 3]):
        x, y = _batch(shape, n=8, seed=i)
        mask = torch.zeros(8, dtype=torch.bool)
        mask[torch.randperm(8, generator=g)[:real]] = True
        x[~mask] = float("nan")  # padding: never read
        model.zero_grad(set_to_none=True)
        got_norms = step.clip_and_accumulate(x, y, max_norm=0.5, sample_mask=mask)
        got = _grads(model)
        model.zero_grad(set_to_none=True)
        ref_norms = memconv.clip_and_accumulate(model, loss_fn, x[mask], y[mask], max_norm=0.5)
        assert_close(got, _grads(model), TOL)
        assert_close(got_norms[mask], ref_norms, TOL)
        assert torch.equal(got_norms[~mask], torch.zeros(8 - real, dtype=got_norms.dtype))
    assert step._prepared.traced.traces == 1
    assert step._prepared.replays == 3  # calls 4 to 6: the compiled step at once
    assert counters["aot_autograd"]["total"] == 1 and not counters["recompiles"]


def test_compiled_norms_of_padded_batches_and_their_finiteness_check():
    """``per_sample_norms`` of a compiled model: the padded samples' norms (the mask an
    input of the graph), per parameter and by group, equal the unpadded batch's; one
    graph per kind of result; a real sample's NaN norm, flagged in the graph, raises
    naming that sample."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), loss_fn)
    kinds = [{}, {"per_parameter": True}, {"groups": "layer"}]
    for i, real in enumerate([5, 3, 6, 2]):
        x, y = _batch(shape, n=8, seed=i)
        mask = torch.arange(8) < real
        x[~mask] = float("nan")  # padding: never read
        for kind in kinds:
            got = step.per_sample_norms(x, y, sample_mask=mask, **kind)
            ref = memconv.per_sample_norms(model, loss_fn, x[mask], y[mask], **kind)
            if isinstance(got, torch.Tensor):
                got, ref = {"": got}, {"": ref}
            assert got.keys() == ref.keys()
            for k in got:
                assert_close(got[k][:real], ref[k], TOL)
                assert torch.equal(got[k][real:], torch.zeros(8 - real, dtype=got[k].dtype))
    assert step._prepared.traced.traces == len(kinds)
    x, y = _batch(shape, n=8, seed=9)
    x[4] = float("nan")
    with pytest.raises(RuntimeError, match="sample\\(s\\) 4 is not finite"):
        step.per_sample_norms(x, y, sample_mask=torch.ones(8, dtype=torch.bool))
    assert step._prepared.traced.traces == len(kinds)  # the compiled graph ran


def test_dropout_in_training_mode_is_refused_not_compiled():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2)).double()
    _warns_and_matches_eager(model, "draws random numbers")
    model.eval()  # no random numbers: compiled
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), nn.CrossEntropyLoss())
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            got = step.per_sample_norms(x, y)
    assert step._prepared.traced.graphs
    assert_close(got, memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y), TOL)


def test_a_hook_with_side_effects_is_refused_not_run_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append(out.shape))
    step, x, y, _ = _warns_and_matches_eager(model, "forward hook .*lambda")
    before = len(seen)
    step.per_sample_norms(x, y)
    assert len(seen) > before  # the hook still runs at every (eager) step


@pytest.mark.parametrize("strategy", ["loop", "rochette", "vmap"])
def test_per_sample_routes_traced_as_the_eager_ones(strategy):
    """The per-sample loop route (one kernel call per sample, stacked when traced) and
    batched ones (a grouped convolution; torch's own kernel with the samples as its
    groups), forced, traced and compiled: the eager numbers."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pairs, step = _steps("tiny-cnn", "grads", strategy=strategy)
    for got, ref in pairs:
        assert_close(got, ref, TOL)
    assert step._prepared.traced.traces == 1


def _loop_cheapest():
    """A CPU calibration under which "auto" prices "loop" (one kernel call per sample)
    below every batched strategy."""
    from memconv.strategies import costs

    data = json.loads(json.dumps(costs.calibration("cpu")))
    data["time"]["loop"] = dict.fromkeys(data["time"]["loop"], 0.0)
    data["time"]["operation"]["per_op"] = 0.0
    return costs.using("cpu", data)


def _conv_backward_calls(step) -> list[int]:
    """Per traced graph, its ``convolution_backward`` nodes."""
    target = torch.ops.aten.convolution_backward.default
    return [
        sum(node.target is target for node in entry.graph.graph.nodes)
        for entry in step._prepared.traced.graphs.values()
    ]


def test_a_traced_step_keeps_to_batched_strategies():
    """Where "auto" takes the per-sample loop eagerly, the traced step takes a batched
    strategy: its graph does not grow with N (a loop would be unrolled into N kernel
    calls per layer), and its numbers are the eager ones."""
    from memconv.strategies.auto import choose
    from memconv.strategies.base import NO_OPTIONS, Problem
    from memconv.strategies.geometry import conv_spec

    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    with _loop_cheapest():
        geom = conv_spec(model[0]).operands(torch.zeros(4, *shape), torch.zeros(4, 4, 8, 8))
        problem = Problem(geom.geometry, 4, shape[1:], 8, True)
        assert choose(problem, NO_OPTIONS)[0].name == "loop"  # the eager plan's choice
        compiled = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), loss_fn)
        eager = memconv.PrivateStep(model, loss_fn)
        for n in (4, 8):
            x, y = _batch(shape, n=n)
            for _ in range(3):  # eager plan, trace, compiled
                got = compiled.per_sample_grads(x, y)
            assert_close(got, eager.per_sample_grads(x, y), TOL)
    calls = _conv_backward_calls(compiled)
    assert len(calls) == 2 and calls[0] == calls[1], calls
    assert calls[0] < 4 * 2  # fewer than one call per sample and layer at N=4


def test_a_traced_clipped_sum_holds_no_computed_weight_for_its_shape():
    """The summed weight VJPs of a traced step (the clipped sum) read a weight's shape
    only: they get a stand-in without storage, so that the graph does not keep the
    weights it computed (NF-ResNet's standardised ones) alive until the clip factors
    are known; the numbers are the eager ones."""
    pairs, compiled = _steps("nf-resnet", "clip")
    for got, ref in pairs:
        assert_close(got[1], ref[1], TOL)
    target = torch.ops.aten.convolution_backward.default
    (entry,) = compiled._prepared.traced.graphs.values()
    weights = [
        node.args[2].meta["val"]
        for node in entry.graph.graph.nodes
        if node.target is target and not node.args[-1][0]  # no input gradient
    ]
    for w in weights:  # one element, whatever the shape
        assert all(st == 0 for st, size in zip(w.stride(), w.shape) if size > 1), w.stride()
    assert weights


def test_a_traced_step_compiles_with_the_models_inductor_options_first():
    """Inductor's step options lie beneath the model's: a mode's options and the
    model's own settings are kept, ``reorder_for_locality`` is off unless the model
    sets it; another backend is passed as it is."""
    from memconv._torch import STEP_INDUCTOR_OPTIONS, compile_backend, step_backend

    model = nn.Linear(2, 2)
    tuned = step_backend(compile_backend(torch.compile(model, mode="max-autotune-no-cudagraphs")))
    assert tuned.config["max_autotune"] and not tuned.config["reorder_for_locality"]
    assert step_backend("inductor").config == STEP_INDUCTOR_OPTIONS
    own = torch.compile(model, options={"reorder_for_locality": True})
    assert step_backend(compile_backend(own)).config["reorder_for_locality"] is True
    assert step_backend("aot_eager") == "aot_eager"


@pytest.mark.parametrize(
    "layers, expected",
    [
        ((nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3, groups=2)), {"layout_optimization": False}),
        ((nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3, groups=4)), {}),  # depthwise: kept
        ((nn.Flatten(), nn.Linear(256, 2)), {}),  # no convolution
    ],
)
def test_a_graph_of_dense_convolutions_compiles_without_inductors_channels_last(layers, expected):
    """Inductor's layout optimisation is off for a traced graph whose convolutions are
    all dense, kept where one is depthwise or none is there; the model's own option
    wins."""
    from memconv._torch import compile_backend, graph_inductor_options, make_fx_real, step_backend

    model = nn.Sequential(*layers)
    graph = make_fx_real(lambda x: model(x).sum(), (torch.randn(1, 4, 8, 8),))
    assert graph_inductor_options(graph) == expected
    config = step_backend("inductor", graph).config
    assert config.get("layout_optimization", True) is expected.get("layout_optimization", True)
    own = torch.compile(model, options={"layout_optimization": True})
    assert step_backend(compile_backend(own), graph).config["layout_optimization"] is True


def test_a_traced_per_sample_steps_grouped_convolutions_are_not_depthwise():
    """The traced DP step of a dense CNN holds memconv's per-sample weight gradients as
    grouped convolutions (the samples as groups, one channel per group at the input):
    they are no depthwise layer, so the graph compiles without channels-last; a
    depthwise layer of the model keeps it."""
    from memconv._torch import graph_inductor_options

    def traced(model):
        step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), nn.MSELoss())
        x, y = torch.randn(5, 1, 8, 8), torch.randn(5, 2)
        for _ in range(2):
            step.clip_and_accumulate(x, y, max_norm=1.0)
        (entry,) = step._prepared.traced.graphs.values()
        groups = [
            n.args[8]
            for n in entry.graph.graph.nodes
            if n.target is torch.ops.aten.convolution.default
        ]
        return graph_inductor_options(entry.graph), groups

    dense = [nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)]
    tail = [nn.Flatten(), nn.Linear(64, 2)]
    options, groups = traced(nn.Sequential(*dense, *tail))
    assert 5 in groups  # the samples as groups
    assert options == {"layout_optimization": False}
    options, _ = traced(nn.Sequential(*dense, nn.Conv2d(4, 4, 3, padding=1, groups=4), *tail))
    assert options == {}


def test_a_graph_off_the_cpu_keeps_inductors_layout_choice():
    """Only the CPU's graphs lose inductor's channels-last layout: elsewhere (here the
    meta device, standing for a GPU) inductor's own choice stands."""
    from memconv._torch import graph_inductor_options, make_fx_real

    conv = nn.Conv2d(4, 4, 3, device="meta")
    graph = make_fx_real(lambda x: conv(x).sum(), (torch.randn(1, 4, 8, 8, device="meta"),))
    assert graph_inductor_options(graph) == {}


def test_a_cuda_graph_backends_outputs_are_copied_before_they_become_grads():
    """A CUDA graph's outputs live in memory its next replay overwrites: a traced step
    compiled by such a backend copies them, so that ``.grad`` accumulated over steps
    (micro-batches) holds each step's sum. On the CPU the ``"cudagraphs"`` backend runs
    the graph as it is; the copy and the accumulation are what is checked."""
    from memconv._torch import graph_owned_outputs

    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the backend's note that the CPU has no CUDA graphs
        compiled = memconv.PrivateStep(torch.compile(model, backend="cudagraphs"), loss_fn)
        batches = [_batch(shape, seed=i) for i in range(4)]
        model.zero_grad(set_to_none=True)
        for x, y in batches:  # eager plan, trace, then compiled: accumulated
            compiled.clip_and_accumulate(x, y, max_norm=0.5)
        got = _grads(model)
    eager = memconv.PrivateStep(model, loss_fn)
    model.zero_grad(set_to_none=True)
    for x, y in batches:
        eager.clip_and_accumulate(x, y, max_norm=0.5)
    assert_close(got, _grads(model), TOL)
    (entry,) = compiled._prepared.traced.graphs.values()
    assert entry.copy_outputs and entry.calls == 2
    assert graph_owned_outputs("cudagraphs") and not graph_owned_outputs("aot_eager")


def test_the_traced_result_is_rebuilt_as_tree_unflatten_builds_it():
    """The result's structure, rebuilt at each compiled call by a builder made once:
    dicts (key order kept), lists, tuples, a named tuple and an ``OrderedDict`` (by
    ``tree_unflatten``), constants in their places."""
    from collections import OrderedDict, namedtuple

    from memconv._torch import pytree_builder, tree_flatten, tree_unflatten
    from memconv.engine.traced import TracedGraph

    Pair = namedtuple("Pair", "a b")
    t = [torch.full((1,), float(i)) for i in range(7)]
    tree = (
        {"z": t[0], "a": [t[1], {"q": t[2]}]},
        [Pair(t[3], 2.5), OrderedDict(b=t[4], a=t[5])],
        (None, "x", t[6]),
    )
    leaves, spec = tree_flatten(tree)
    assert repr(pytree_builder(spec)(iter(leaves))) == repr(tree_unflatten(leaves, spec))
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    constants = {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}
    graph = TracedGraph(None, lambda *xs: list(xs), spec, constants, 0.0)
    got = graph(tuple(tensors))
    assert repr(got) == repr(tree) and list(got[0]) == ["z", "a"]
    assert type(got[1][0]) is Pair and type(got[1][1]) is OrderedDict
    assert graph.calls == 1 and graph.compile_seconds is not None


# ------------------------------------------- the steady state: the compiled step again
@pytest.fixture
def frozen_clock(monkeypatch):
    """The clock of the ``"available"`` budget's readings stopped: the first reading
    serves every call (a call of the tests below may take longer than the readings'
    lifetime, and a new reading plans again)."""
    from memconv.engine import prepared as prepared_module

    monkeypatch.setattr(prepared_module, "_clock", lambda: 0.0)


def _warm(step, x, y, task):
    """Three calls: probed and planned, traced, compiled; the next same call replays."""
    for _ in range(3):
        _call(step, x, y, task)
    assert step._prepared.replays == 0


def _tiny_step():
    """``(model, loss_fn, step, shape)``: the tiny CNN in float64 and a
    :class:`memconv.PrivateStep` of it compiled with ``aot_eager``."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), loss_fn)
    return model, loss_fn, step, shape


def _warm_tiny(task):
    """``(model, loss_fn, step, x, y)``: :func:`_tiny_step`'s step warmed up on
    ``(x, y)`` for ``task`` (:func:`_warm`)."""
    model, loss_fn, step, shape = _tiny_step()
    x, y = _batch(shape, seed=1)
    _warm(step, x, y, task)
    return model, loss_fn, step, x, y


def _call(step, x, y, task):
    if task == "clip":
        step.model._orig_mod.zero_grad(set_to_none=True)
        norms = step.clip_and_accumulate(x, y, max_norm=0.5)
        return norms, _grads(step.model._orig_mod)
    if task == "norms":
        return step.per_sample_norms(x, y, groups="layer")
    return step.per_sample_grads(x, y)


def _eager(model, loss_fn, x, y, task):
    step = memconv.PrivateStep(model, loss_fn)
    grads = {k: p.grad for k, p in model.named_parameters()}
    try:
        return _call(_Unwrapped(step), x, y, task)
    finally:
        for k, p in model.named_parameters():
            p.grad = grads[k]


class _Unwrapped:
    """An eager PrivateStep seen as ``_call`` sees a compiled one."""

    def __init__(self, step):
        self._step = step
        self.model = type("M", (), {"_orig_mod": step.model})()

    def __getattr__(self, name):
        return getattr(self._step, name)


def _same(got, ref):
    if isinstance(ref, tuple):
        for a, b in zip(got, ref):
            _same(a, b)
    else:
        assert_close(got, ref, TOL)


@pytest.mark.parametrize("task", ["grads", "norms", "clip"])
def test_the_same_call_again_runs_the_compiled_step_at_once(task, frozen_clock):
    """From the fourth call on, a call asking for the step the last one ran (the same
    request, model, loss, options, layouts) runs its compiled graph without planning:
    no new probe, plan or trace, and the numbers of the eager path on each new batch."""
    model, loss_fn, step, shape = _tiny_step()
    _warm(step, *_batch(shape, seed=0), task)
    prepared = step._prepared
    probes, plans, traces = prepared.probes, prepared.plans, prepared.traced.traces
    for seed in range(1, 4):
        x, y = _batch(shape, seed=seed)
        _same(_call(step, x, y, task), _eager(model, loss_fn, x, y, task))
    assert prepared.replays == 3
    assert (prepared.probes, prepared.plans, prepared.traced.traces) == (probes, plans, traces)


def _no_bias_grad(model, loss_fn):
    model[-1].bias.requires_grad_(False)


def _eval(model, loss_fn):
    model.eval()


def _new_parameter(model, loss_fn):
    model[-1].weight = nn.Parameter(model[-1].weight.detach() * 2)


def _new_module(model, loss_fn):
    model[4] = nn.Tanh()


def _renamed(model, loss_fn):  # the same modules under other names
    model._modules = dict(zip([f"m{i}" for i in range(len(model))], model._modules.values()))


CHANGES = {
    "requires_grad": _no_bias_grad,
    "eval": _eval,
    "new parameter": _new_parameter,
    "new module": _new_module,
    "renamed": _renamed,
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("task", ["grads", "clip"])
def test_a_changed_model_is_planned_again_not_replayed(change, task, frozen_clock):
    """Whatever the probe and the plan depend on (see :mod:`memconv.engine.prepared`)
    changed between two calls: the call after the change plans (no replay) and gives
    the eager numbers of the changed model."""
    model, loss_fn, step, shape = _tiny_step()
    _warm(step, *_batch(shape, seed=0), task)
    x, y = _batch(shape, seed=1)
    _call(step, x, y, task)
    assert step._prepared.replays == 1
    CHANGES[change](model, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _call(step, x, y, task)
    assert step._prepared.replays == 1
    _same(got, _eager(model, loss_fn, x, y, task))


def test_a_module_forward_hook_added_is_planned_again_not_replayed(frozen_clock):
    model, loss_fn, step, x, y = _warm_tiny("grads")
    handle = model[2].register_forward_hook(lambda m, i, o: o * 2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = step.per_sample_grads(x, y)
        assert step._prepared.replays == 0
        _same(got, memconv.per_sample_grads(model, loss_fn, x, y))
    finally:
        handle.remove()


def test_a_global_module_hook_added_is_planned_again_not_replayed(frozen_clock):
    model, loss_fn, step, x, y = _warm_tiny("grads")

    def double_relu(module, inputs, output):
        return output * 2 if isinstance(module, nn.ReLU) else None

    handle = nn.modules.module.register_module_forward_hook(double_relu)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = step.per_sample_grads(x, y)
            ref = memconv.per_sample_grads(model, loss_fn, x, y)
        assert step._prepared.replays == 0
        _same(got, ref)
    finally:
        handle.remove()


def _other_loss(step):
    step.loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)


def _other_strategy(step):
    step.strategy = "unfold"


def _other_budget(step):
    step.memory_budget = None


OTHER_CALLS = {"loss": _other_loss, "strategy": _other_strategy, "budget": _other_budget}


@pytest.mark.parametrize("change", list(OTHER_CALLS))
def test_another_loss_strategy_or_budget_is_planned_again_not_replayed(change, frozen_clock):
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), nn.CrossEntropyLoss())
    x, y = _batch(shape, seed=1)
    _warm(step, x, y, "grads")
    OTHER_CALLS[change](step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = step.per_sample_grads(x, y)
    assert step._prepared.replays == 0
    ref = memconv.per_sample_grads(
        model, step.loss_fn, x, y, strategy=step.strategy, memory_budget=step.memory_budget
    )
    _same(got, ref)


def test_a_save_memory_block_around_the_call_is_planned_again_not_replayed(frozen_clock):
    model, loss_fn, step, x, y = _warm_tiny("norms")
    with memconv.save_memory("shift"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = step.per_sample_norms(x, y, groups="layer")
        ref = memconv.per_sample_norms(model, loss_fn, x, y, groups="layer")
    assert step._prepared.replays == 0
    _same(got, ref)


def test_autocast_around_the_call_is_planned_again_not_replayed(frozen_clock):
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), loss_fn)
    x, y = _batch(shape, seed=1)
    x = x.float()
    _warm(step, x, y, "norms")
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = step.per_sample_norms(x, y)
        ref = memconv.per_sample_norms(model, loss_fn, x, y)
    assert step._prepared.replays == 0
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_an_available_budget_read_again_and_changed_is_planned_again(monkeypatch):
    """An ``"available"`` budget is read again as a call that plans reads it: a reading
    that changed plans the call (the same plan and step), one that did not replays."""
    from memconv.engine import prepared as prepared_module

    now, reading = [0.0], [2**34]
    monkeypatch.setattr(prepared_module, "_clock", lambda: now[0])
    monkeypatch.setattr(prepared_module, "resolve_budget", lambda *args: reading[0])
    model, loss_fn, step, x, y = _warm_tiny("grads")
    step.per_sample_grads(x, y)
    assert step._prepared.replays == 1
    now[0] += 1.0  # read again, the same: replayed
    step.per_sample_grads(x, y)
    assert step._prepared.replays == 2
    now[0] += 1.0
    reading[0] += 4096  # read again, changed: planned
    got = step.per_sample_grads(x, y)
    assert step._prepared.replays == 2
    _same(got, memconv.per_sample_grads(model, loss_fn, x, y))
    step.per_sample_grads(x, y)  # the new reading's step
    assert step._prepared.replays == 3
    assert step._prepared.traced.traces == 1


def test_tasks_in_turn_each_replay_their_own_step(frozen_clock):
    """Three tasks called in turn keep one record each: each call after the warm-up
    replays its own task's step (the clipping route read by the clipping call is its
    own plan's) and gives the eager numbers."""
    model, loss_fn, step, shape = _tiny_step()
    x, y = _batch(shape, seed=0)
    for task in ("grads", "norms", "clip") * 3:
        _call(step, x, y, task)
    assert step._prepared.replays == 0
    for seed in (1, 2):
        x, y = _batch(shape, seed=seed)
        for task in ("grads", "norms", "clip"):
            _same(_call(step, x, y, task), _eager(model, loss_fn, x, y, task))
            assert step._prepared.plan.task == task
    assert step._prepared.replays == 6


def test_parameters_put_in_another_layout_are_planned_again(frozen_clock):
    """``model.to(memory_format=torch.channels_last)`` between two calls keeps the
    parameter objects and changes their strides, to which inductor's code is
    specialised (it asserts them): the call after it traces again, not replays."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(torch.compile(model, backend="inductor"), loss_fn)
    x, y = _batch((2, 6, 6), seed=1, classes=3)
    _warm(step, x, y, "norms")
    model.to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    for _ in range(3):
        got = step.per_sample_norms(x, y)
    assert step._prepared.replays == 0 and step._prepared.traced.traces == 2
    assert_close(got, memconv.per_sample_norms(model, loss_fn, x, y), 1e-9)


@pytest.mark.parametrize("task", ["norms", "clip"])
def test_another_loss_function_on_the_same_compiled_model_traces_its_own_step(task):
    """The plain functions keep one prepared step per model: a call with another loss
    function (its operations are in the traced graph) gets a step of its own, and the
    first loss' step is found again when that loss comes back."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    compiled = torch.compile(model, backend="aot_eager")
    x, y = _batch(shape, seed=1)
    plain = nn.CrossEntropyLoss()
    smoothed = nn.CrossEntropyLoss(label_smoothing=0.2)

    def call(m, loss_fn):
        if task == "norms":
            return memconv.per_sample_norms(m, loss_fn, x, y)
        model.zero_grad(set_to_none=True)
        return memconv.clip_and_accumulate(m, loss_fn, x, y, max_norm=0.1), _grads(model)

    for loss_fn in (plain, smoothed, plain, smoothed):
        for _ in range(3):
            got = call(compiled, loss_fn)
        _same(got, call(model, loss_fn))
    assert compiled.__dict__["_memconv_prepared"].prepared.traced.traces == 2


def test_a_loss_made_anew_at_every_call_keeps_its_compiled_step(frozen_clock):
    """``nn.CrossEntropyLoss()`` written in the loop is a new object at every call that
    computes the same: the compiled step is found again (one trace), the calls replay
    it, and the numbers are the eager path's."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model = model.double()
    compiled = torch.compile(model, backend="aot_eager")
    x, y = _batch(shape, seed=1)
    for _ in range(5):
        got = memconv.per_sample_norms(compiled, nn.CrossEntropyLoss(), x, y)
    prepared = compiled.__dict__["_memconv_prepared"].prepared
    assert prepared.traced.traces == 1 and prepared.replays == 2
    assert_close(got, memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y), TOL)


def _ce(output, target, smoothing=0.0):
    return nn.functional.cross_entropy(output, target, label_smoothing=smoothing)


class _Scaled(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.inner = nn.CrossEntropyLoss()
        self.me = self  # a cycle the key must not follow forever

    def forward(self, output, target):
        return self.scale * self.inner(output, target)


class _Callable:
    def __call__(self, output, target):
        return nn.functional.cross_entropy(output, target)


def _closure(value):
    return lambda output, target: value * nn.functional.cross_entropy(output, target)


def test_the_loss_key_says_what_a_loss_computes():
    """:func:`memconv.engine.traced.loss_key`: equal for losses that compute the same
    (made anew), different for losses that do not; hashable."""
    import functools

    from memconv.engine.traced import loss_key

    w = torch.ones(3)
    same = [
        (nn.CrossEntropyLoss(), nn.CrossEntropyLoss()),
        (nn.CrossEntropyLoss(weight=w), nn.CrossEntropyLoss(weight=w)),
        (_Scaled(2.0), _Scaled(2.0)),
        (_closure(2.0), _closure(2.0)),
        (functools.partial(_ce, smoothing=0.1), functools.partial(_ce, smoothing=0.1)),
        (_ce, _ce),
    ]
    other = [
        (nn.CrossEntropyLoss(), nn.CrossEntropyLoss(label_smoothing=0.1)),
        (nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum")),
        (nn.CrossEntropyLoss(), nn.NLLLoss()),
        (nn.CrossEntropyLoss(weight=w), nn.CrossEntropyLoss(weight=torch.ones(3))),
        (_Scaled(2.0), _Scaled(3.0)),
        (_Scaled(1.0), _Scaled(True)),
        (_closure(2.0), _closure(3.0)),
        (functools.partial(_ce, smoothing=0.1), functools.partial(_ce, smoothing=0.2)),
        (_Callable(), _Callable()),  # an object of its own: by identity
    ]
    for a, b in same:
        assert loss_key(a) == loss_key(b) and hash(loss_key(a)) == hash(loss_key(b))
    for a, b in other:
        assert loss_key(a) != loss_key(b)
    lossy = nn.CrossEntropyLoss()
    key = loss_key(lossy)
    lossy.label_smoothing = 0.3  # the same object changed: another key
    assert loss_key(lossy) != key


@pytest.mark.parametrize("groups", ["all", "layer"])
@pytest.mark.parametrize("how", ["PrivateStep", "block"])
def test_a_threshold_changed_at_every_step_keeps_the_compiled_step(how, groups, frozen_clock):
    """Adaptive clipping written by hand: ``max_norm`` moves at every step (one number,
    or one per layer). The thresholds are an input of the traced step, not constants
    of its graph: one trace, compiled from the third step (replayed from the fourth,
    for ``PrivateStep``), and at every step the eager path's clipped sum and norms."""
    model, loss_fn, step, shape = _tiny_step()
    compiled = step.model
    names = [name for name, _ in model.named_children() if any(True for _ in _.parameters())]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for i in range(6):
            x, y = _batch(shape, n=8, seed=i)
            c = 0.05 * (i + 1)
            max_norm = c if groups == "all" else {n: c * (k + 1) for k, n in enumerate(names)}
            _clip_checked(how, step, model, loss_fn, x, y, max_norm=max_norm, groups=groups)
    if how == "block":
        traced = _block_traced(compiled)
        assert traced.traces == 1 and [s.calls for s in traced.splits.values()] == [4]
    else:
        traced = step._prepared.traced
        assert traced.traces == 1 and [g.calls for g in traced.graphs.values()] == [4]
        assert step._prepared.replays == 3


def test_calls_that_each_need_a_new_step_warn_once_naming_what_changed():
    """A loss whose closure takes a new value at every call (an annealed weight): each
    call's step is new, so none is ever compiled; the third such call warns once,
    naming the loss, and the numbers are the eager path's throughout."""
    model, _, step, shape = _tiny_step()
    x, y = _batch(shape, seed=1)
    messages = []
    for i in range(6):
        loss_fn = _closure(1.0 + i)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = memconv.per_sample_norms(step.model, loss_fn, x, y)
        messages += [str(w.message) for w in caught if "ran eagerly" in str(w.message)]
        # attributed to the user's call, not to memconv's insides
        assert all(w.filename == __file__ for w in caught if "ran eagerly" in str(w.message))
        assert_close(got, memconv.per_sample_norms(model, loss_fn, x, y), TOL)
    assert len(messages) == 1
    assert "last 3 calls" in messages[0] and "what the loss function computes" in messages[0]
    prepared = step.model.__dict__["_memconv_prepared"].prepared
    assert prepared.traced.traces == 0


@pytest.mark.parametrize("how", ["PrivateStep", "block"])
def test_a_module_attribute_changed_between_calls_traces_again(how, frozen_clock):
    """A compiled step holds a module's plain attributes as constants (here GroupNorm's
    ``eps``): changed between calls, the step is traced again for the new value (never
    the old graph's numbers), and the first graph serves the old value again."""
    model, loss_fn, step, shape = _tiny_step()
    compiled = step.model
    for i, eps in enumerate([1e-5] * 3 + [0.5] * 3 + [1e-5]):
        model[1].eps = eps
        x, y = _batch(shape, n=8, seed=i)
        _clip_checked(how, step, model, loss_fn, x, y, max_norm=0.1)
    traced = _block_traced(compiled) if how == "block" else step._prepared.traced
    assert traced.traces == 2


@pytest.mark.parametrize("how", ["PrivateStep", "block"])
def test_a_counter_in_forward_runs_eagerly_with_one_warning(how):
    """A module whose forward changes its own plain attribute at every call: each
    call's step is new (a trace holds what the forward reads of it as a constant, as
    Dynamo's guards do), so the calls run eagerly, with one warning naming the
    attribute; the numbers are the eager path's throughout."""
    torch.manual_seed(0)
    model, shape = _tiny_cnn()
    model.insert(3, CallCounter())
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    compiled = torch.compile(model, backend="aot_eager")
    step = memconv.PrivateStep(compiled, loss_fn)
    x, y = _batch(shape, seed=1)
    messages = []
    for _ in range(5):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _clip_checked(how, step, model, loss_fn, x, y, max_norm=0.1)
        messages += [str(w.message) for w in caught if "ran eagerly" in str(w.message)]
    assert len(messages) == 1 and "plain attribute of a module" in messages[0]
    traced = _block_traced(compiled) if how == "block" else step._prepared.traced
    assert traced.traces == 0


def test_module_attributes_read_the_plain_values_again():
    from memconv.engine.traced import ModuleAttributes

    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2), nn.LeakyReLU(0.1))
    model[2].tag = "a"
    model[2]._flag = False
    model[2].table = {"a": 1.0}
    model[2].act = torch.relu
    record = ModuleAttributes(model)
    names = {k for _, k in record.pairs + record.held}
    assert {"stride", "padding", "eps", "negative_slope", "tag", "_flag", "table", "act"} <= names
    assert not names & {"_parameters", "_buffers", "_modules", "_forward_hooks"}
    before = record.values()
    assert hash(before) == hash(record.values()) and before == record.values()
    for change, plain in (
        (lambda: setattr(model[2], "_flag", True), True),
        (lambda: setattr(model[2], "act", torch.tanh), True),  # a function: by identity
        (lambda: model[2].table.update(a=2.0), True),  # in place
        (lambda: setattr(model[2], "negative_slope", 0.2), True),
        (lambda: setattr(model[0], "stride", (2, 2)), True),
        (lambda: setattr(model[2], "tag", torch.ones(3)), False),  # the key: by identity
        (lambda: delattr(model[2], "tag"), False),
    ):
        change()
        now = record.values()
        assert now != before and hash(now) is not None
        assert not record.same(list(before))
        assert record.same(list(now)) == plain  # (never the same otherwise: no replay)
        before = now


class _PeftLora(nn.Module):
    """A LoRA layer holding what peft's ``lora.Linear`` holds: the scaling per adapter in
    a dict, and whether the adapters are disabled in a private flag whose default is
    the class's (set on the layer when they are)."""

    _disable_adapters = False

    def __init__(self, base: nn.Linear, r: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        self.scaling = {"default": 2.0}

    def forward(self, x):
        out = self.base_layer(x)
        if self._disable_adapters:
            return out
        a, b = self.lora_A["default"], self.lora_B["default"]
        return out + b(a(x)) * self.scaling["default"]


@pytest.mark.parametrize("change", ["scaling", "disabled"])
def test_lora_scaling_or_disabled_adapters_changed_between_calls_trace_again(change):
    """peft-style LoRA on a compiled model: the scaling changed in its dict (in place),
    or the adapters disabled by the private flag, between calls: the next call traces
    its own step and gives the eager numbers."""
    torch.manual_seed(0)
    head = _PeftLora(nn.Linear(16, 10))
    nn.init.normal_(head.lora_B["default"].weight)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 16), head)
    model = model.double()
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(torch.compile(model, backend="aot_eager"), loss_fn)
    for i in range(9):
        if i == 3:
            if change == "scaling":
                head.scaling["default"] = 0.5
            else:
                head._disable_adapters = True
        if i == 6:  # (back: the first step again, or the flag now the layer's own)
            if change == "scaling":
                head.scaling["default"] = 2.0
            else:
                head._disable_adapters = False
        x, y = _batch((3, 6, 6), n=8, seed=i)
        _clip_checked("PrivateStep", step, model, loss_fn, x, y, max_norm=0.1)
    # the flag set on the layer is a new model state: its probe drops the first graph
    assert step._prepared.traced.traces == (2 if change == "scaling" else 3)
