"""Which route covers each use of a trainable parameter in the graph of the loss —
graph analysis on the calls a walk recorded, testable without a model.

Every use of a parameter (an edge into its ``AccumulateGrad`` node) is attributed to
the innermost call that can differentiate it (:func:`assign`):

- a **rule call**: a layer with a rule (:func:`memconv.layers.find_rule`), called
  with positional tensors only, no hooks, batch axis first (or movable), for the
  layer's own parameters (:func:`rule_for`);
- an **operation call**: a call of an operation with a rule
  (:mod:`memconv.layers.operations`) on parameters or on functions of parameters alone
  (:class:`memconv.engine.calls.OpCall`), for the uses inside its window and, for a computed
  weight, the uses in that weight's graph (:func:`claims`);
- a **generic call**: any other call of a parametrised module, for the parameters of
  its subtree;
- otherwise the **model route**: a parameter used outside the modules that own it, in
  the loss function, or in a parent's ``forward``.

A parameter whose uses all lie in rule calls is summed over them; a generic call
covers every use inside it (nested calls included), so no use is counted twice and
none is missed.
"""

from __future__ import annotations

from torch import Tensor, nn

from .._torch import global_module_hooks, module_hooks, sequence_nr
from ..layers import LayerRule, find_rule, own_trainable
from ..layers.operations import BoundOp
from .calls import LayerCall, OpCall
from .probes import UNSPLIT


def hooked(module: nn.Module, ours) -> bool:
    """Whether hooks other than memconv's own may change the module's call."""
    others = [k for k in module_hooks(module) if k not in ours]
    return bool(others or global_module_hooks())


def rule_for(
    module, args, kwargs, in_axes, output, out_axes, ours, others: bool | None = None
) -> LayerRule | None:
    """The rule of a call if the call is one the rule describes exactly, else None
    (``others``: :func:`hooked` of the module, if the caller has it)."""
    rule = find_rule(module)
    if others is None:
        others = hooked(module, ours)
    if rule is None or kwargs or others:
        return None
    if not args or not all(isinstance(a, Tensor) for a in args) or not isinstance(output, Tensor):
        return None
    axes = (*in_axes, *out_axes)
    if all(a == 0 for a in axes):
        return rule
    if rule.movable_batch_axis and all(a is not None and a != UNSPLIT for a in axes):
        return rule
    return None


def use_graph(*roots) -> tuple[set, dict]:
    """Nodes reachable from ``roots``, and the uses of leaves: ``{id(parameter):
    [sequence numbers of the using nodes]}``."""
    reachable: set = set()
    uses: dict[int, list[int]] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in reachable:
            continue
        reachable.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:
                uses.setdefault(id(variable), []).append(sequence_nr(node))
            if child not in reachable:
                stack.append(child)
    return reachable, uses


def deepest(captured: set, reachable: set) -> set:
    """The captured nodes with no captured node below them (backward direction):
    asking autograd for those runs every captured node reachable."""
    below: dict = {}
    stack = [(n, False) for n in captured & reachable]
    seen: set = set()
    while stack:
        node, children_done = stack.pop()
        children = [c for c, _ in node.next_functions if c is not None]
        if children_done:
            below[node] = any(c in captured or below.get(c, False) for c in children)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c in children if c not in seen)
    return {n for n in captured & reachable if not below[n]}


def covered_by_module(module: nn.Module, bound: BoundOp, ours, known: dict) -> bool:
    """Whether the operation call is the body of a layer whose rule serves it: the
    layer has a rule, no other hooks, and the call's parameters are its own
    (``known``: ``{module: ids of its own trainable parameters, or None}``, filled
    during one walk, in which neither the rules nor the hooks change)."""
    if module not in known:
        covers = find_rule(module) is not None and not hooked(module, ours)
        known[module] = {id(p) for p in own_trainable(module).values()} if covers else None
    own = known[module]
    return own is not None and all(t is None or id(t) in own for t in bound.slots.values())


def claims(ops: list, reachable: set, names: dict) -> dict:
    """``{op call: {id(parameter): sequence numbers of its uses}}`` the calls' computed
    slots account for: the nodes of each slot's graph, which must reach trainable
    parameters only, and into which every edge from the rest of the graph must come
    from the call itself (else some gradient would bypass the calls). A slot that
    fails is dropped from its call (its parameters' uses go to other routes)."""
    if not ops:
        return {}
    graphs: dict = {}  # (call, slot) -> (nodes, {pid: parameter}, {pid: seqs})
    for call in ops:
        for slot, root in call.roots.items():
            nodes: set = set()
            leaves: dict = {}
            seqs: dict = {}
            stack, ok = [root], True
            while stack and ok:
                node = stack.pop()
                if node in nodes:
                    continue
                nodes.add(node)
                for child, _ in node.next_functions:
                    if child is None:
                        continue
                    if hasattr(child, "variable"):
                        v = child.variable
                        if id(v) not in names:
                            ok = False
                            break
                        leaves[id(v)] = v
                        seqs.setdefault(id(v), set()).add(sequence_nr(node))
                    elif child not in nodes:
                        stack.append(child)
            if ok:
                graphs[(call, slot)] = (nodes, leaves, seqs)
    while True:
        inside: set = set().union(*(g[0] for g in graphs.values())) if graphs else set()
        entries: dict = {}
        for (call, slot), _ in graphs.items():
            entries.setdefault(call.roots[slot], []).append(call.window)
        bad = set()
        for node in reachable:
            if node in inside:
                continue
            for child, _ in node.next_functions:
                if child is None or child not in inside:
                    continue
                s = sequence_nr(node)
                if not any(lo < s < hi for lo, hi in entries.get(child, ())):
                    bad.add(child)
        if not bad:
            break
        graphs = {k: g for k, g in graphs.items() if not (g[0] & bad)}
    out: dict = {}
    for call in ops:
        for slot in list(call.roots):
            if (call, slot) not in graphs:
                del call.roots[slot]
                call.sources.pop(slot, None)
                continue
            _, leaves, seqs = graphs[(call, slot)]
            call.sources[slot] = (call.sources[slot][0], leaves)
            mine = out.setdefault(call, {})
            for pid, ss in seqs.items():
                mine.setdefault(pid, set()).update(ss)
    return out


def assignment_key(calls: list, uses: dict, names: dict) -> tuple | None:
    """All that :func:`assign` reads of layer calls (no operation call, no reversible
    block: their claims read the graph itself): each call's module, rule and window, and
    each parameter's uses, the sequence numbers counted from the first call's start. Two
    walks with equal keys get the same assignment; None where there is no key."""
    if not calls or any(type(c) is not LayerCall for c in calls):
        return None
    base = calls[0].window[0]
    return (
        tuple((c.module, c.rule, c.window[0] - base, c.window[1] - base) for c in calls),
        tuple((pid, tuple(s - base for s in uses.get(pid, ()))) for pid in names),
    )


def share(calls: list, calls_per_param: dict) -> None:
    """Fill each call's :attr:`~memconv.engine.calls.LayerCall.shared`: its parameters
    that other calls' routes compute too."""
    for call in calls:
        call.shared = {k for k, full in call.params.items() if calls_per_param.get(full, 0) > 1}


def assign(calls: list[LayerCall], uses: dict, names: dict, claims: dict) -> tuple[list, dict]:
    """Give each parameter's uses to routes (see the module docstring): the innermost
    rule call of a module owning the parameter, else the operation calls that account
    for the use, else the innermost generic call, else the model route.

    Fills each call's :attr:`~memconv.engine.calls.LayerCall.params` and
    :attr:`~memconv.engine.calls.LayerCall.shared`.

    Returns:
        ``(model_params, calls_per_param)``: the model names of the parameters left to
        the model route, and ``{model name: number of calls whose route computes it}``.
    """
    model_params: list = []
    calls_per_param: dict = {}
    ops = [c for c in calls if isinstance(c, OpCall)]
    windows = sorted((c for c in calls if not isinstance(c, OpCall)), key=lambda c: c.window[0])
    # {id(p): name in module} of the parameters each call's route can compute (a
    # parameter under two names: the first)
    routable: dict = {}
    for call in windows:
        if call.rule is not None:
            own = own_trainable(call.module).items()
        else:
            own = call.module.named_parameters(remove_duplicate=False)
        local: dict = {}
        for k, p in own:
            local.setdefault(id(p), k)
        routable[call] = local
    for call in ops:
        routable[call] = dict(call.direct)
        for pid in claims.get(call, {}):
            routable[call][pid] = names[pid]

    for pid, model_name in names.items():
        seqs = uses.get(pid, [])
        if not seqs:
            continue
        chosen: list[LayerCall] = []
        left_to_model = False
        for s in seqs:
            inner = None
            for call in windows:
                lo, hi = call.window
                if lo < s < hi and pid in routable[call]:
                    if inner is None or call.window[0] >= inner.window[0]:
                        inner = call
            picks = [inner] if inner is not None and inner.rule is not None else []
            if not picks:
                picks = [
                    c
                    for c in ops
                    if (pid in c.direct and c.window[0] < s < c.window[1])
                    or s in claims.get(c, {}).get(pid, ())
                ]
            if not picks and inner is not None:
                picks = [inner]
            if not picks:
                left_to_model = True
                break
            chosen.extend(c for c in picks if c not in chosen)
        if left_to_model:
            model_params.append(model_name)
            continue
        outer = []
        for c in chosen:
            around = [
                o
                for o in chosen
                if o is not c
                and o.rule is None
                and o.window[0] < c.window[0]
                and c.window[1] < o.window[1]
            ]
            if not around:
                outer.append(c)
                continue
            # a generic call covers the uses inside its window only
            lo, hi = around[0].window
            if any(not lo < s < hi for s in claims.get(c, {}).get(pid, ())):
                left_to_model = True
        if left_to_model:
            model_params.append(model_name)
            continue
        for call in outer:
            call.params[routable[call][pid]] = model_name
        calls_per_param[model_name] = len(outer)
    share(calls, calls_per_param)
    return model_params, calls_per_param
