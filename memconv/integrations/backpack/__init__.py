"""BackPACK integration: first-order extensions on convolutions through memconv.

memconv plugs in where BackPACK itself chooses the weight-Jacobian algorithm of a
convolution: its derivatives classes subclass BackPACK's ``ConvNDDerivatives`` (and
``ConvTransposeNDDerivatives``) and are given to BackPACK's own module-extension
classes, which :func:`install` sets on extension objects with BackPACK's
``set_module_extension``. Installing and restoring are explicit::

    from backpack import backpack, extend, extensions
    import memconv
    from memconv.integrations import backpack as mb

    model = extend(memconv.convert(model))
    ext = mb.install(extensions.BatchGrad())
    with memconv.save_memory("shift"), backpack(ext):
        lossfunc(model(X), y).backward()      # the forward pass records the block
    mb.uninstall(ext)                         # BackPACK's own mapping, exactly

or ``with mb.installed(extensions.BatchGrad()) as ext: ...``. Covered: the first-order
``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared`` and ``Variance``, and the
second-order ``{Batch}DiagGGN{Exact,MC}``, ``{Batch}DiagHessian`` and
``SqrtGGN{Exact,MC}`` (:mod:`.secondorder`; by default the GGN extensions' backward pass
runs over chunks of the factor's rows to a lean budget, :mod:`.chunking`) and the
Kronecker-factored ``KFAC``, ``KFLR`` and ``KFRA`` (:mod:`.kronecker`, which also
supplies adaptive pooling and BatchNorm in eval mode, where BackPACK has no module
extension) and ConvNeXt's layers (:mod:`.layers`: ``LayerNorm2d``, ``nn.LayerNorm``,
the layer scale and ``nn.GELU``, made modules by :func:`extend`, BackPACK's converter
for timm's and torchvision's ConvNeXt);
the strategy is the one the layer's forward pass recorded (the rule of
:class:`memconv.save_memory`). memconv's
layers that are not convolutions get BackPACK's module extension of the ``torch.nn``
class they subclass, for every extension. ``model=`` names module paths in the
refusals and refuses what it can before the forward pass (:mod:`.naming`). No global
hook, and no state outside the extension objects you pass but the module paths of the
models given to ``model=`` or :func:`extend` (held weakly, for the refusals' messages);
:func:`routed` routes the blocks that third-party code opens (laplace-torch's
backends), for the time of a ``with`` block.

This module does not import BackPACK until a function is called; without it, they
raise an ``ImportError`` naming the extra to install.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import threading
import warnings
import weakref

from torch import nn

from ..._checks import (
    CONV_TRANSPOSE_TYPES,
    CONV_TYPES,
    KRON_GROUPS,
    LEAN,
    check_batch,
    check_budget,
    check_choice,
)
from ..._torch import compiled_inner
from ...conv import settings as context
from ...conv.vjp import check_settings
from ...engine.losses import per_sample_losses
from ...engine.prepared import check_per_sample_model, parameter_names
from ...modules import CONVERSIONS, convert

#: Module extensions each installed extension object had before, to give back exactly.
_previous: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ABSENT = object()
#: The key under which :data:`_previous` records a KFLR object's added branch rule.
_ACCUMULATION = object()


def _sum(existing, other):
    return existing + other


def _require():
    try:
        import backpack  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "memconv.integrations.backpack needs BackPACK: pip install 'memconv[backpack]'"
        ) from err
    from . import extensions

    return extensions


def _mapping(ext) -> dict:
    # BackPACK exposes set_module_extension but no getter: its mapping is read here
    # only to give back exactly the objects that were there before install().
    return ext._BackpropExtension__module_extensions


def _check_budget(memory_budget) -> None:
    check_budget(memory_budget, available=False, lean=True)


def install(*exts, memory_budget=LEAN, model=None, kron_groups="blocks"):
    """Route the convolution weight Jacobians of BackPACK extension objects through memconv.

    For each covered extension object, every ``torch.nn`` and memconv convolution and
    transposed-convolution class is mapped to BackPACK's own module extension built
    with memconv's derivatives, and every other memconv layer class to BackPACK's
    module extension of the ``torch.nn`` class it subclasses. Installing an object
    twice changes nothing.

    Args:
        *exts: BackPACK extension objects (e.g. ``backpack.extensions.BatchGrad()``).
            An extension memconv does not cover (the curvature-matrix products)
            keeps BackPACK's convolutions, with a warning naming it; memconv's layers
            are mapped for it all the same.
        memory_budget: what the factor of ``DiagGGN{Exact,MC}``,
            ``BatchDiagGGN{Exact,MC}`` and ``SqrtGGN{Exact,MC}`` may take: their
            backward pass runs over chunks of the factor's ``V`` rows that fit it
            (:mod:`memconv.integrations.backpack.chunking`; the ``"memconv"`` logger
            says how many chunks at INFO level), so the peak does not grow with the
            model's outputs; within it the chunks (and the Gram factors kept over
            them) are those predicted fastest. ``"lean"`` (the default): 4× the
            bytes of the layer inputs and outputs the forward pass stored (the
            activations; ``chunking.LEAN_FACTOR``), at least 16 MiB, derived per
            backward pass; a positive int: bytes; None: one pass, the whole factor
            kept, as BackPACK. Not used by the other extensions; a budget in bytes
            given for ``{Batch}DiagHessian`` or ``KFLR``, whose factors have ``V``
            rows too but are not chunked, warns that it is not honoured.
        model: the extended model (optional): its module paths name the layers in
            memconv's refusals, and what the backward pass would refuse (a layer an
            extension has no module extension for, a parameter shared by several
            layers) is refused now, before any work
            (:func:`memconv.integrations.backpack.naming.check_model`).
        kron_groups: ``KFAC``/``KFLR``/``KFRA`` on a grouped convolution:
            ``"blocks"`` (one Kronecker product per group, 3-d factors) or
            ``"average"`` (one product with BackPACK's 2-d shapes, the input averaged
            over the groups); see
            :func:`memconv.integrations.backpack.kronecker.module_extension`.

    Returns:
        The extension object (or the tuple of them, for several).

    Raises:
        ImportError: if BackPACK is not installed.
        TypeError: if an argument is not a BackPACK extension object, or
            ``memory_budget`` is not an int, ``"lean"`` or None.
        ValueError: if ``memory_budget`` is not positive or ``kron_groups`` unknown;
            for a ``model`` with a parameter shared by several layers (``BatchGrad``
            excepted), naming them.
        NotImplementedError: for a ``model`` with a layer with trainable parameters
            that an extension has no module extension for, naming its path.

    Warns:
        UserWarning: for an extension memconv does not cover, and for a
            ``memory_budget`` in bytes that an extension's backward pass cannot honour.
    """
    extensions = _require()
    _check_budget(memory_budget)
    check_choice(kron_groups, KRON_GROUPS, "kron_groups", none=False)
    from backpack.extensions.backprop_extension import BackpropExtension

    for ext in exts:
        if not isinstance(ext, BackpropExtension):
            raise TypeError(f"install expects BackPACK extension objects, got {type(ext).__name__}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"install's model must be a torch.nn.Module, got {type(model).__name__}")
    done = []
    try:
        for ext in exts:
            if ext not in _previous:
                _install_one(ext, memory_budget, model, extensions, kron_groups)
                done.append(ext)
    except BaseException:
        uninstall(*done)  # none of this call's objects left half-installed
        raise
    if model is not None:
        from .naming import remember

        remember(model)
    return exts[0] if len(exts) == 1 else exts


def _install_one(ext, memory_budget, model, extensions, kron_groups="blocks") -> None:
    from . import chunking, naming
    from .kronecker import KFLR, OTHER_LAYERS
    from .kronecker import module_extension as kronecker_module_extension
    from .layers import LAYERS
    from .layers import module_extension as layer_module_extension

    mapping = _mapping(ext)
    new = {}
    for torch_cls, memconv_cls in CONVERSIONS.items():
        if torch_cls in extensions.DERIVATIVES and isinstance(ext, extensions.COVERED):
            module_ext = extensions.module_extension(ext, torch_cls)
        else:  # KFAC/KFLR/KFRA: convolutions, and BatchNorm in eval mode
            module_ext = kronecker_module_extension(ext, torch_cls, kron_groups=kron_groups)
        if module_ext is not None:
            new[torch_cls] = new[memconv_cls] = module_ext
        elif torch_cls in mapping:
            new[memconv_cls] = mapping[torch_cls]
    for cls in OTHER_LAYERS:  # classes memconv does not convert (adaptive pooling)
        module_ext = None if cls in new else kronecker_module_extension(ext, cls)
        if module_ext is not None:
            new[cls] = module_ext
    for cls in LAYERS:  # ConvNeXt's layers BackPACK lacks (GELU, LayerNorm2d, ...)
        module_ext = None if cls in new else layer_module_extension(ext, cls)
        if module_ext is not None:
            new[cls] = module_ext
            if cls in CONVERSIONS:  # nn.LayerNorm: memconv's LayerNorm too
                new.setdefault(CONVERSIONS[cls], module_ext)
    if not any(cls in new for cls in extensions.DERIVATIVES):
        warnings.warn(
            f"memconv does not cover the BackPACK extension {type(ext).__name__}; its "
            "convolution quantities keep BackPACK's own computation (memconv's layers "
            "get BackPACK's module extensions of the torch.nn classes they subclass)",
            stacklevel=3,
        )
    if isinstance(memory_budget, int) and isinstance(ext, chunking.UNCHUNKED):
        warnings.warn(
            f"memconv cannot honour memory_budget={memory_budget} for the BackPACK "
            f"extension {type(ext).__name__}: its backward pass runs in one pass, the "
            "factor with all its rows kept (memconv chunks DiagGGNExact, "
            "BatchDiagGGNExact and SqrtGGNExact; for a ReLU network DiagHessian "
            "equals DiagGGNExact); install it without memory_budget",
            stacklevel=3,
        )
    if model is not None:
        covered = any(cls in new for cls in extensions.DERIVATIVES)
        naming.check_model(model, ext, {**mapping, **new}, tied=covered)
    if memory_budget is not None and isinstance(ext, chunking.CHUNKED):
        for cls in {**mapping, **new}:
            new[cls] = chunking.Deferred(new.get(cls, mapping.get(cls)), memory_budget)
    _previous[ext] = {cls: mapping.get(cls, _ABSENT) for cls in new}
    if isinstance(ext, KFLR) and "accumulate_backpropagated_quantities" not in vars(ext):
        # BackPACK's KFLR has no rule for branches (residual additions): its square
        # roots add up there, as KFAC's do
        ext.accumulate_backpropagated_quantities = _sum
        _previous[ext][_ACCUMULATION] = _ABSENT
    for cls, module_ext in new.items():
        ext.set_module_extension(cls, module_ext, overwrite=True)


def extend(module, debug: bool = False, use_converter: bool = True):
    """``backpack.extend(module, use_converter=True)`` that also converts the layers
    of networks written as timm writes ConvNeXt (``LayerNorm2d``, the layer scale
    ``gamma``) into modules BackPACK's extensions see, for which :func:`install`
    supplies module extensions (:mod:`.converter`, :mod:`.layers`).

    A ``torch.compile``'d model is extended through the module it wraps, which is
    returned and runs eagerly, with a warning: BackPACK's extensions act through module
    hooks that store their quantities on the modules, which a compiled graph would not
    run at each step. To run them compiled, compile the extended model and call
    :func:`step`.

    Args:
        module: the model.
        debug: BackPACK's debug messages.
        use_converter: False: ``backpack.extend(module)``, nothing rewritten.

    Returns:
        The extended model (BackPACK's converter returns a ``torch.fx.GraphModule``).

    Warns:
        RuntimeWarning: for a ``torch.compile``'d model (its eager module is extended
            and returned).

    Raises:
        ImportError: if BackPACK is not installed.
    """
    _require()
    from .converter import extend as convert_and_extend
    from .naming import remember

    inner = compiled_inner(module)
    if inner is not None:
        warnings.warn(
            f"memconv.integrations.backpack.extend: the torch.compile'd "
            f"{type(inner).__name__} is extended through the module it wraps, which is "
            "returned and runs eagerly: BackPACK's extensions store their quantities "
            "from module hooks, which a compiled graph would not run at each step. Pass "
            "the uncompiled model to silence this warning; to run the extensions "
            "compiled, compile the extended model and call "
            "memconv.integrations.backpack.step(compiled, lossfunc, x, y, *extensions).",
            RuntimeWarning,
            stacklevel=2,
        )
        module = inner
    extended = convert_and_extend(module, debug=debug, use_converter=use_converter)
    remember(extended)  # the refusals name its layers' paths
    return extended


def uninstall(*exts) -> None:
    """Give extension objects exactly the module extensions they had before :func:`install`.

    Objects that were not installed are left alone.
    """
    for ext in exts:
        previous = _previous.pop(ext, None)
        if previous is None:
            continue
        if previous.pop(_ACCUMULATION, None) is not None:
            del ext.accumulate_backpropagated_quantities
        mapping = _mapping(ext)
        for cls, module_ext in previous.items():
            if module_ext is _ABSENT:
                mapping.pop(cls, None)
            else:
                ext.set_module_extension(cls, module_ext, overwrite=True)


@contextlib.contextmanager
def installed(*exts, memory_budget=LEAN, model=None, kron_groups="blocks"):
    """:func:`install` (with its ``memory_budget``, ``model`` and ``kron_groups``) for
    the duration of a ``with`` block, then :func:`uninstall`.

    Yields:
        The extension object (or the tuple of them).
    """
    result = install(*exts, memory_budget=memory_budget, model=model, kron_groups=kron_groups)
    try:
        yield result
    finally:
        uninstall(*exts)


#: How many :func:`routed` blocks are open in this thread (or asyncio task), and the
#: innermost one's arguments of :func:`install`.
_routing: contextvars.ContextVar = contextvars.ContextVar(
    "memconv_backpack_routed", default=(0, {})
)
_patch_lock = threading.Lock()
#: BackPACK's own ``backpack.__enter__``/``__exit__`` while any routed block is open.
_patched: dict = {}


@contextlib.contextmanager
def routed(memory_budget=LEAN, model=None, kron_groups="average"):
    """Route every BackPACK ``with backpack(...)`` block opened inside through memconv.

    For third-party code that builds its own extension objects (laplace-torch's
    ``BackPackGGN``/``BackPackEF`` create ``DiagGGNExact``, ``KFAC``, ... inside their
    own blocks): each ``backpack(*exts)`` block entered inside ``routed()`` installs
    its extension objects on entry (:func:`install`, those already installed left
    alone) and gives them back their own module extensions on exit
    (:func:`uninstall`)::

        from laplace import Laplace
        from memconv.integrations import backpack as mb

        with mb.routed():
            la = Laplace(model, "classification", hessian_structure="diag")
            la.fit(loader)

    While a ``routed()`` block is open anywhere in the process, BackPACK's
    ``backpack`` class has memconv's entry and exit methods (which call BackPACK's
    own); the last ``routed()`` to close gives the class back its own methods, so no
    state is left. Which blocks are routed is decided per thread (and per asyncio
    task, by a :mod:`contextvars` variable): blocks that other threads open are not
    routed. An extension object shared between threads while one of them routes it
    sees the memconv mapping in all of them until the block exits.

    Args:
        memory_budget: as :func:`install`'s, for every block's extensions.
        model: as :func:`install`'s: the model the blocks run (its module paths in
            refusals, and each block's extensions checked on it when the block opens,
            before the forward pass).
        kron_groups: as :func:`install`'s, but ``"average"`` by default: third-party
            code expects BackPACK's 2-d Kronecker factors (laplace-torch's ``Kron``
            adds them to ``[C_out, C_out]`` and ``[C_in/G·K, C_in/G·K]`` zeros, which
            would broadcast memconv's per-group blocks into wrong factors, silently).

    Yields:
        None.

    Raises:
        ImportError: if BackPACK is not installed.
        TypeError, ValueError: for a ``memory_budget`` or ``kron_groups``
            :func:`install` refuses.
    """
    _require()
    _check_budget(memory_budget)
    check_choice(kron_groups, KRON_GROUPS, "kron_groups", none=False)
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"routed's model must be a torch.nn.Module, got {type(model).__name__}")
    import backpack

    with _patch_lock:
        if not _patched:
            cls = backpack.backpack
            _patched.update(__enter__=cls.__enter__, __exit__=cls.__exit__)
            cls.__enter__, cls.__exit__ = _routed_enter, _routed_exit
        _patched["count"] = _patched.get("count", 0) + 1
    arguments = dict(memory_budget=memory_budget, model=model, kron_groups=kron_groups)
    token = _routing.set((_routing.get()[0] + 1, arguments))
    try:
        yield
    finally:
        _routing.reset(token)
        with _patch_lock:
            _patched["count"] -= 1
            if not _patched["count"]:
                cls = backpack.backpack
                cls.__enter__, cls.__exit__ = _patched["__enter__"], _patched["__exit__"]
                _patched.clear()


def _routed_enter(block):
    installed_here = ()
    depth, arguments = _routing.get()
    if depth:
        installed_here = tuple(ext for ext in block.exts if ext not in _previous)
        install(*installed_here, **arguments)
    block._memconv_installed = installed_here
    return _patched["__enter__"](block)


def _routed_exit(block, *exc):
    try:
        return _patched["__exit__"](block, *exc)
    finally:
        uninstall(*getattr(block, "_memconv_installed", ()))
        block._memconv_installed = ()


def step(model, lossfunc, inputs, targets, *extensions):
    """One forward and backward pass under BackPACK's extensions, compiled for a
    ``torch.compile``'d model.

    Equivalent to ``with backpack(*extensions): lossfunc(model(inputs),
    targets).backward()``: the parameters' ``.grad`` accumulate the loss's gradient and
    each extension's savefield is set on them. For a model that is not compiled, that
    is what runs. For a ``torch.compile``'d model (``torch.compile(mb.extend(net))``), the
    step is traced at its first call with new shapes or settings and compiled with the
    model's backend; the next calls run the compiled graph
    (:mod:`memconv.integrations.backpack.compiled`). A change of the extension objects,
    their installed module extensions, a :func:`memconv.integrations.backpack.routed`
    or :class:`memconv.save_memory` block, a module's training mode, a parameter's
    ``requires_grad`` or the inputs' shapes, dtypes and devices traces a new graph; the
    earlier ones are kept.

    Args:
        model: the extended model (``mb.extend(net)`` or BackPACK's ``extend``), or a
            ``torch.compile``'d one.
        lossfunc: the extended loss module (BackPACK's ``extend(nn.CrossEntropyLoss())``,
            ``nn.MSELoss``, ...).
        inputs: ``[N, ...]``.
        targets: ``[N, ...]``.
        *extensions: BackPACK extension objects (``KFAC()``, ``DiagGGNExact()``, ...),
            installed (:func:`memconv.integrations.backpack.install`) or not.

    Returns:
        The loss, detached (a scalar tensor).

    Raises:
        TypeError: for a ``model`` that is not a ``torch.nn.Module``, ``inputs`` or
            ``targets`` that are not tensors, or an extension that is not a BackPACK
            extension object. Before any work.
        RuntimeError: if a parameter got a gradient but no savefield of an extension
            (a model that is not extended: ``mb.extend``).

    Warns:
        RuntimeWarning: when a compiled model's step runs eagerly (the reason named).
    """
    _require()
    from .compiled import check, run

    check(model, inputs, targets, extensions)
    depth, arguments = _routing.get()
    routing = tuple((k, id(v)) for k, v in arguments.items()) if depth else None
    installed = tuple(
        (type(e), id(e), tuple((cls, id(m)) for cls, m in _mapping(e).items())) for e in extensions
    )
    return run(model, lossfunc, inputs, targets, extensions, state=(routing, installed))


#: Trainable layers BackPACK's BatchGrad supports (checked before any work).
_SUPPORTED = (
    nn.Linear,
    *CONV_TYPES,
    *CONV_TRANSPOSE_TYPES,
    nn.modules.batchnorm._BatchNorm,
    nn.Embedding,
)


def per_sample_grads(model, loss_fn, inputs, targets, *, strategy=None):
    """:func:`memconv.per_sample_grads` with BackPACK's ``BatchGrad`` as the engine.

    A deep copy of ``model`` is converted, extended and run with an installed
    ``BatchGrad`` (the user's model gets no BackPACK hooks and no state).

    Args:
        model, loss_fn, inputs, targets, strategy: as :func:`memconv.per_sample_grads`.

    Returns:
        ``{name: Tensor [N, *param.shape]}`` for every trainable parameter.

    Raises:
        ImportError: if BackPACK is not installed.
        TypeError, ValueError: as :func:`memconv.per_sample_grads`, and for a
            trainable layer BackPACK's ``BatchGrad`` does not support. Before any work.
        RuntimeError: if a parameter the loss depends on got no ``grad_batch``.
    """
    _require()
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    settings = context.use_block_settings(strategy)
    check_per_sample_model(model)
    n = check_batch(inputs, targets)
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and not isinstance(module, _SUPPORTED):
            raise ValueError(
                f"BackPACK engine: layer {name!r} ({type(module).__name__}) has trainable "
                "parameters BackPACK's BatchGrad does not support; use memconv.per_sample_grads"
            )
        if isinstance(module, CONV_TYPES + CONV_TRANSPOSE_TYPES):
            from ...strategies.geometry import conv_spec

            check_settings(settings, conv_spec(module).geometry)
    names = parameter_names(model)
    if n == 0:
        params = {id(p): p for p in model.parameters()}
        return {name: params[i].new_zeros(0, *params[i].shape) for i, name in names.items()}
    work = extend(convert(copy.deepcopy(model)))
    with installed(BatchGrad()) as ext, context.activate(settings), backpack(ext):
        output = work(inputs.detach())
        per_sample_losses(loss_fn, output, targets).sum().backward()
    out = {}
    for name, p in work.named_parameters():
        if not p.requires_grad:
            continue
        batch = getattr(p, "grad_batch", None)
        if batch is None and p.grad is not None:
            raise RuntimeError(f"BackPACK computed no grad_batch for parameter {name!r}")
        out[name] = batch.detach() if batch is not None else p.new_zeros(n, *p.shape)
    return {name: out[name] for name in names.values()}
