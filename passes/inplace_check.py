"""``InplaceCheck``: name the in-place op that breaks backward, before backward runs.

Autograd's most confusing message — "one of the variables needed for gradient computation has
been modified by an inplace operation: ... is at version 1; expected version 0" — is raised in
``backward()``, long after the forward line that caused it. The graph knows better: during one
example run with autograd recording, ``torch.autograd.graph.saved_tensors_hooks`` shows every
tensor each node saves for its backward, and the tensor's version counter (bumped by every
in-place write: ``add_``, ``relu_``, ``+=``, ``inplace=True`` modules, ``x[i] = ...``) shows which
later node wrote into it. That is exactly the check autograd makes at backward time, made per
node at instrument time.

Each such pair becomes a finding (``InplaceCheck.findings``, the report's notes, the modifying
node's ``notes`` in the picture) and a guard inserted right before the modifying node: when the
forward runs with grad enabled and the saving node was recorded by autograd, the guard raises
``InplaceError`` naming both nodes and the fix, before the tensor is overwritten. With grad off
(``torch.no_grad()``, inference) the guard is one Python call that returns at once. The guard
returns nothing and no node reads it, so outputs stay bitwise equal to the model's.

An in-place op that writes into a tensor nobody saved — ``relu_`` after a conv, which saved its
input and weight, not its output — is no finding and gets no guard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Interpreter, Node

from fxdebug import InplaceError, MissingInputsError, UsageError
from fxdebug.authoring import (
    GUARD, Options, Pass, PassContext, PassResult, Where, is_instrumentation, keep_state, matches, module_path,
    node_meta, node_values, op_label, source_line,
)

__all__ = ["InplaceCheck", "InplaceFinding"]


@dataclass(frozen=True)
class InplaceFinding:
    """One in-place write into a tensor that another node saved for backward.

    Attributes:
        saved_by: node whose backward needs the tensor; ``saved_by_line`` its source line.
        modified_by: node that writes into it; ``modified_by_line`` its source line.
        tensor: what the saving node saved (``"its output"``, ``"its input 'x'"``, ``"parameter fc.weight"``).
        shape: that tensor's shape.
    """

    saved_by: str
    saved_by_op: str
    saved_by_module: str
    saved_by_line: str | None
    modified_by: str
    modified_by_op: str
    modified_by_module: str
    modified_by_line: str | None
    tensor: str
    shape: tuple[int, ...]
    fix: str = "use the out-of-place form, or clone() the tensor before the in-place op."

    @property
    def message(self) -> str:
        saved_at = f" at {self.saved_by_line}" if self.saved_by_line else ""
        mod_at = f" at {self.modified_by_line}" if self.modified_by_line else ""
        return (
            f"node '{self.modified_by}' ({self.modified_by_op}, module {self.modified_by_module or '<root>'}){mod_at} "
            f"modifies in place a tensor {list(self.shape)} that node '{self.saved_by}' ({self.saved_by_op}, module "
            f"{self.saved_by_module or '<root>'}){saved_at} saved for backward ({self.tensor}); backward would fail "
            "with 'one of the variables needed for gradient computation has been modified by an inplace operation'. "
            f"Fix: {self.fix}"
        )

    def __str__(self) -> str:
        return self.message


def inplace_guard(anchor: Any, *, message: str, node: str, module: str, op: str, saved_by: str) -> None:
    """Raise ``InplaceError`` if autograd is recording and recorded the saving node (``anchor``).

    Inserted before the modifying node. With grad disabled it returns at once.
    """
    if not torch.is_grad_enabled():
        return None
    recorded = any(isinstance(t, Tensor) and t.requires_grad for t in torch.utils._pytree.tree_leaves(anchor))
    if recorded:
        raise InplaceError(message, node=node, module=module, op=op, saved_by=saved_by, pass_name="inplace-check")
    return None


def _fix(node: Node, gm: GraphModule) -> str:
    """The concrete out-of-place spelling for ``node``, then the clone() alternative."""
    clone = "or clone() the tensor before it (`y = y.clone()`)."
    target = str(node.target)
    if node.op == "call_method" and target.endswith("_"):
        return f"use the out-of-place form `.{target[:-1]}(...)` instead of `.{target}(...)`, {clone}"
    if node.op == "call_module":
        return f"build module '{target}' with inplace=False, {clone}"
    name = getattr(node.target, "__name__", target).split(".")[0]  # aten overloads: "add_.Tensor"
    if name == "setitem":
        return f"build the new tensor out of place (torch.where, torch.cat, index_put), {clone}"
    if name.startswith("i") and getattr(node.target, "__module__", "") in ("_operator", "operator"):
        return f"write `y = y {_OPERATORS.get(name, '+')} ...` instead of the augmented assignment, {clone}"
    if node.kwargs.get("inplace"):
        return f"pass inplace=False to {op_label(node)}, {clone}"
    if name.endswith("_"):
        return f"use the out-of-place {name[:-1]} instead of {name} (`y = y + 1` rather than `y += 1`), {clone}"
    return f"use the out-of-place form, {clone}"


_OPERATORS = {"iadd": "+", "isub": "-", "imul": "*", "itruediv": "/", "ifloordiv": "//", "ipow": "**",
              "imatmul": "@", "iand": "&", "ior": "|", "ixor": "^"}


class _Saved:
    __slots__ = ("saver", "tensor", "version")

    def __init__(self, saver: Node, tensor: Tensor, version: int) -> None:
        self.saver, self.tensor, self.version = saver, tensor, version


class _SaveTracker(Interpreter):
    """Runs the graph with autograd recording; attributes each saved tensor to its node and
    each version bump of a saved tensor to the node that caused it."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.extra_traceback = False
        self.saved: list[_Saved] = []
        self.pairs: list[tuple[_Saved, Node]] = []
        self._current: Node | None = None

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        if str(target).startswith("*"):
            return next(self.args_iter)
        return super().placeholder(target, args, kwargs)

    def _pack(self, t: Tensor) -> Tensor:
        if self._current is not None:
            self.saved.append(_Saved(self._current, t, t._version))
        return t

    def run_node(self, n: Node) -> Any:
        if is_instrumentation(n):
            return None
        if n.op in ("placeholder", "get_attr", "output"):
            return super().run_node(n)
        self._current = n
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            value = super().run_node(n)
        self._current = None
        still = []
        for rec in self.saved:
            if rec.tensor._version != rec.version:
                if rec.saver is not n:  # a node that saves then writes its own tensor fails inside itself
                    self.pairs.append((rec, n))
            else:
                still.append(rec)
        self.saved = still
        return value


def _what(rec: _Saved, env: dict[Node, Any], gm: GraphModule) -> str:
    t = rec.tensor

    def same(v: Any) -> bool:
        return isinstance(v, Tensor) and v.shape == t.shape and v.data_ptr() == t.data_ptr()

    for name, p in list(gm.named_parameters()) + list(gm.named_buffers()):
        if same(p):
            return f"parameter {name}" if isinstance(p, torch.nn.Parameter) else f"buffer {name}"
    if any(same(v) for v in torch.utils._pytree.tree_leaves(env.get(rec.saver))):
        return "its output"
    for i, a in enumerate(rec.saver.all_input_nodes):
        if any(same(v) for v in torch.utils._pytree.tree_leaves(env.get(a))):
            return f"its input '{a.name}'"
    return "a tensor computed inside it"


class InplaceCheck(Pass):
    """Find in-place ops that overwrite tensors saved for backward; raise before they run.

    Args:
        where: limit the *modifying* nodes that get guards (globs / predicate); findings are
            reported for every pair regardless, so a narrowed check still tells the whole story.
        raise_at_runtime: insert the guards (default). ``False`` only reports the findings.

    After ``instrument`` the pass holds ``findings`` (a list of ``InplaceFinding``).
    """

    name = "inplace-check"
    observe_only = True

    def __init__(self, *, where: Where = None, raise_at_runtime: bool = True) -> None:
        super().__init__(where=where)
        self.raise_at_runtime = Options(self).flag("raise_at_runtime", raise_at_runtime)
        self.findings: list[InplaceFinding] = []

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        if ctx.inputs is None:
            raise MissingInputsError("InplaceCheck needs example inputs to see what autograd saves: "
                             "call instrument(model, [InplaceCheck()], example_inputs=(x,)).")
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        bound = node_values(gm, ctx, placeholders)
        args = [bound[p.name] for p in placeholders]
        tracker = _SaveTracker(gm)
        with keep_state(gm), torch.enable_grad():
            tracker.run(*args)
            env = tracker.env
            self.findings = []
            seen: set[tuple[str, str]] = set()
            pairs: list[tuple[Node, Node]] = []
            for rec, mod in tracker.pairs:
                if (rec.saver.name, mod.name) in seen:
                    continue
                seen.add((rec.saver.name, mod.name))
                pairs.append((rec.saver, mod))
                self.findings.append(InplaceFinding(
                    saved_by=rec.saver.name, saved_by_op=op_label(rec.saver),
                    saved_by_module=module_path(rec.saver), saved_by_line=source_line(rec.saver),
                    modified_by=mod.name, modified_by_op=op_label(mod),
                    modified_by_module=module_path(mod), modified_by_line=source_line(mod),
                    tensor=_what(rec, env, gm), shape=tuple(rec.tensor.shape), fix=_fix(mod, gm)))
            del tracker, env
        added: list[Node] = []
        for (saver, mod), finding in zip(pairs, self.findings):
            node_meta(mod).notes = [*node_meta(mod).notes, f"inplace-check: {finding.message}"]
            if not self.raise_at_runtime or not matches(self.where, mod):
                continue
            with gm.graph.inserting_before(mod):
                guard = gm.graph.call_function(inplace_guard, (saver,), {
                    "message": finding.message, "node": mod.name, "module": finding.modified_by_module,
                    "op": finding.modified_by_op, "saved_by": saver.name})
            meta = node_meta(guard)
            meta.watch(GUARD)
            ctx.record(guard, {"guards": mod.name})
            meta.module, meta.added_by = finding.modified_by_module, self.name
            added.append(guard)
        return PassResult(gm, added=added, notes=[f.message for f in self.findings])
