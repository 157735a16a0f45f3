"""``ParamUpdates(optimizer)``: how far each optimizer step moved each parameter, without a sync.

Update-norm spikes come before loss spikes: a step that moves a weight by far more, relative to
its size, than the steps before it is the warning. ``ParamUpdates`` hooks the optimizer's step
(``register_step_pre_hook`` / ``register_step_post_hook``): before the step it copies the
parameters into buffers it keeps; after it, one ``torch._foreach_norm`` of the differences and one
of the old weights go into a small table on the device. Per parameter it keeps

* ``update_norm`` — the L2 norm of the last step's change;
* ``update_ratio`` — that norm over the weight's L2 norm before the step;
* ``update_spike`` — the largest factor by which a step's ratio exceeded the running median of the
  ratios of the steps before it (the last 64; from the 4th step on), and the step it happened at.

Nothing is read back to the host until the report is. The report row of the node that calls a
module (for a parameter read directly, the node that uses it) carries the module's figures — its
parameters together, plus ``param_updates``, each parameter's own by name — and
``Report.findings()`` gives ``kind="update_spike"`` where a parameter's factor reaches 10
(``findings(update_spike=...)`` changes it). ``ParamUpdates(...).rows()`` lists every parameter
the optimizer holds, keyed by name; ``.history()`` each one's update ratios of the last 64
steps. Costs: one copy of the parameters in memory, and per step a copy, an in-place
subtraction and two norms over them (one ``torch._foreach_*`` call each) and two rows written; the
ratios, running medians and spikes are computed for 64 steps at once (every 64th step, or when read).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

import fxdebug
from fxdebug.authoring import (
    HIDDEN, Column, FindingRule, ObservationContext, Pass, PassContext, PassResult, Probe, Reductions,
    is_instrumentation, matches, module_path,
)

__all__ = ["ParamUpdates"]

WINDOW = 64  # steps in the running median
_LAST = ("norm", "ratio", "spike", "spike_ratio", "spike_step", "skipped")  # what host() reads
WARMUP = 3  # ratios needed before a step can be called a spike
SPIKE = 10.0


def _columns() -> tuple[Column, ...]:
    spike = FindingRule(
        kind="update_spike", option="update_spike",
        message=("{where}: at optimizer step {update_spike_step} the update of {update_spike_param}, relative to "
                 "its weight, was {value}x its running median (threshold {threshold}x)."),
        fix=("check that parameter group's learning rate and schedule, and the gradient at that step; clip "
             "gradients or lower the learning rate."))
    return (
        Column("update_norm", format=".3g", doc="L2 norm of the last step's change of the module's parameters"),
        Column("update_ratio", format=".3g", doc="last update norm / weight norm before that step"),
        Column("update_spike", format=".1f", doc="largest jump of a parameter's update ratio over its running median",
               threshold=SPIKE, finding=spike),
        Column("update_spike_param", roles=HIDDEN, doc="the parameter whose update ratio jumped most"),
        Column("update_spike_step", roles=HIDDEN, doc="the optimizer step (0-based) of that jump"),
        Column("update_spike_ratio", roles=HIDDEN, doc="the update ratio at that step"),
        Column("param_updates", roles=HIDDEN, doc="each parameter's update_norm, update_ratio, update_spike by name"),
        Column("update_skipped", roles=HIDDEN, doc="the last optimizer step was taken back by fxdebug.guard (update 0)"),
        Column("history_updates", roles=HIDDEN,
               doc="each recent step's update figures under its forward call (merged into Report.history)"),
    )


class UpdateTable:
    """The device table behind ``ParamUpdates``: one row per parameter of the optimizer.

    A step costs a copy of the parameters (before), an in-place subtraction and two norms (after),
    each one ``torch._foreach_*`` call, and two rows written into a block of pending steps: the
    update norms and the weight norms, as they are. Every ``WINDOW`` steps, and whenever the figures
    are read, the block is folded into the table at once on the device (``_fold``): the ratios,
    each step's running median over the ``WINDOW`` ratios before it, the spikes, the last figures,
    the rings of recent steps. Nothing per step in Python per parameter; nothing read to the host."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.names: dict[int, str] = {}
        self.steps = 0  # steps taken (folded or pending)
        self._state: dict[str, Tensor] | None = None
        self._before: list[Tensor] = []
        self._layout: list[tuple[Any, Any]] = []  # (shape, dtype) of each parameter the buffers were made for
        self._had_grad: list[bool] = []
        self._one_device: torch.device | None = None  # the parameters' device, when they share one
        self._pending: list[tuple[list[bool], bool]] = []  # per pending step: which parameters had a gradient,
        #                                                     whether fxdebug.guard flagged it
        self.call = -1  # the model's last forward call (set by the probes; host-side, no sync)
        self.calls: list[int] = []  # per step in the rings (oldest first) and pending: its forward call
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _fresh(self, device: torch.device) -> dict[str, Tensor]:
        n = len(self.params)
        f32 = dict(dtype=torch.float32, device=device)
        nan = float("nan")
        return {"norm": torch.full((n,), nan, **f32), "ratio": torch.full((n,), nan, **f32),
                "history": torch.full((n, WINDOW), nan, **f32),  # the last WINDOW steps' ratios, oldest first
                "spike": torch.zeros(n, **f32), "spike_ratio": torch.zeros(n, **f32),
                "spike_step": torch.full((n,), -1, dtype=torch.int64, device=device),
                "norms": torch.full((n, WINDOW), nan, **f32),  # each step's update norms (for the recorder's history)
                "skipped_ring": torch.zeros(WINDOW, dtype=torch.bool, device=device),
                "skipped": torch.zeros((), dtype=torch.bool, device=device),  # the last step was taken back
                # the block of pending steps, one row each: update norms, weight norms, guard's flag
                "upd": torch.zeros(WINDOW, n, **f32), "wn": torch.zeros(WINDOW, n, **f32),
                "flag": torch.zeros(WINDOW, **f32)}

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            self.params = params  # add_param_group after ParamUpdates was made: the table starts afresh
            self.index = {id(p): i for i, p in enumerate(params)}
            self._state, self._before, self._pending = None, [], []
            self.calls = []
        layout = [(p.shape, p.dtype) for p in params]
        if layout != self._layout:
            self._before = [torch.empty_like(p, memory_format=torch.preserve_format).detach() for p in params]
            self._layout = layout
            devices = {p.device for p in params}
            self._one_device = devices.pop() if len(devices) == 1 else None
        self._had_grad = [p.grad is not None for p in params]
        if not params:
            return
        s = self._table(params[0].device)
        with torch.no_grad():
            torch._foreach_copy_(self._before, params)
            self._norms_into(s["wn"][len(self._pending)], self._before)  # while it is in cache

    def _norms_into(self, row: Tensor, tensors: list[Tensor]) -> None:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        if self._one_device != row.device:  # parameters on several devices
            norms = [n.to(row.device, non_blocking=True) for n in norms]
        torch.stack(norms, out=row)

    def _table(self, device: torch.device) -> dict[str, Tensor]:
        if self._state is None or self._state["norm"].device != device:  # the parameters moved: start afresh
            self._state, self._pending, self.calls = self._fresh(device), [], []
        return self._state

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.params:
            return
        s = self._table(self.params[0].device)
        k = len(self._pending)
        with torch.no_grad():
            torch._foreach_sub_(self._before, self.params)  # in place: minus the update
            self._norms_into(s["upd"][k], self._before)
            # fxdebug.guard sets this on the optimizer for the step (1.0: the step is taken back, on
            # the device): such a step changed nothing, whatever the parameters held at this hook
            flag = getattr(optimizer, "fxdebug_skipped", None)
            if isinstance(flag, Tensor):
                s["flag"][k].copy_(flag.reshape(()), non_blocking=True)
        self._pending.append((self._had_grad, isinstance(flag, Tensor)))
        self.calls.append(self.call)
        self.steps += 1
        if len(self._pending) == WINDOW:
            self._fold()

    def _fold(self) -> None:
        """The pending steps into the table, all at once (device ops only, no sync): each step's
        ratio, the running median of the ``WINDOW`` ratios before it, spikes, last figures, rings."""
        s, pending = self._state, self._pending
        if s is None or not pending:
            return
        k, n, dev = len(pending), len(self.params), s["norm"].device
        first = self.steps - k  # the step index of the first pending step
        stepped = torch.tensor([had for had, _flag in pending], dtype=torch.bool).to(dev, non_blocking=True)  # (k, n)
        flagged = torch.tensor([f for _had, f in pending], dtype=torch.bool).to(dev, non_blocking=True)
        taken = (s["flag"][:k] > 0) & flagged  # (k,): steps fxdebug.guard took back
        upd = torch.where(taken[:, None], 0.0, s["upd"][:k])  # a step taken back moved nothing
        wn = s["wn"][:k]
        applied = stepped & ~taken[:, None]
        ratio = torch.where(applied & (wn > 0), upd / wn, float("nan"))  # (k, n); NaN: outside the median
        # each step's running median: over the WINDOW ratios before it (the ring, then the block)
        seen = torch.cat([s["history"], ratio.t()], dim=1)  # (n, WINDOW + k), oldest first
        windows = seen.unfold(1, WINDOW, 1)[:, :k]  # (n, k, WINDOW): window j ends just before step j
        median = windows.nanmedian(dim=2).values
        enough = (~windows.isnan()).sum(2) >= WARMUP
        r = ratio.t()
        jump = torch.where(enough & (median > 0) & ~r.isnan(), r / median, 0.0)
        jump = torch.nan_to_num(jump, nan=0.0, posinf=float(torch.finfo(torch.float32).max))
        at = jump.argmax(dim=1, keepdim=True)  # the first step of the block with the largest jump
        best = jump.gather(1, at).squeeze(1)
        higher = best > s["spike"]
        s["spike"] = torch.where(higher, best, s["spike"])
        s["spike_ratio"] = torch.where(higher, r.gather(1, at).squeeze(1), s["spike_ratio"])
        s["spike_step"] = torch.where(higher, at.squeeze(1) + first, s["spike_step"])
        # the last figures: from each parameter's last step with a gradient in the block, if any
        last = torch.where(stepped, torch.arange(k, device=dev)[:, None], -1).amax(dim=0, keepdim=True)  # (1, n)
        has = last.squeeze(0) >= 0
        at_last = last.clamp(min=0)
        shown = torch.where(taken[:, None], 0.0, ratio)  # a step taken back: an update of 0
        s["norm"] = torch.where(has, upd.gather(0, at_last).squeeze(0), s["norm"])
        s["ratio"] = torch.where(has, shown.gather(0, at_last).squeeze(0), s["ratio"])
        s["history"] = seen[:, -WINDOW:].contiguous()
        s["norms"] = torch.cat([s["norms"], torch.where(stepped, upd, float("nan")).t()], dim=1)[:, -WINDOW:].contiguous()
        s["skipped_ring"] = torch.cat([s["skipped_ring"], taken])[-WINDOW:].contiguous()
        s["skipped"] = taken[-1].clone()
        self._pending = []
        del self.calls[:-WINDOW]

    def host(self) -> dict[str, list[Any]] | None:
        """The table as Python lists (the one sync)."""
        self._fold()
        if self._state is None or self._state["norm"].device.type == "meta":
            return None
        return {k: self._state[k].cpu().tolist() for k in _LAST}

    def per_step(self) -> list[tuple[int, int, list[float | None], list[float | None], bool]]:
        """``[(step, forward call, update norms, update ratios, taken back), ...]`` of the steps in
        the rings, oldest first (one read of the rings)."""
        self._fold()
        state = self._state
        if state is None or not self.steps or state["norm"].device.type == "meta":
            return []
        norms, ratios, skipped = (state[k].cpu() for k in ("norms", "history", "skipped_ring"))
        n = min(self.steps, WINDOW, len(self.calls))
        out = []
        for j in range(n):
            col = WINDOW - n + j
            out.append((self.steps - n + j, self.calls[len(self.calls) - n + j],
                        [_num(v) for v in norms[:, col].tolist()], [_num(v) for v in ratios[:, col].tolist()],
                        bool(skipped[col])))
        return out

    def ratios(self) -> tuple[Tensor, int] | None:
        """The ratio ring (parameters x ``WINDOW``, oldest first) and how many of its steps are real."""
        self._fold()
        state = self._state
        if state is None or not self.steps or state["history"].device.type == "meta":
            return None
        return state["history"], min(self.steps, WINDOW)

    def had_grad(self, i: int) -> bool:
        """Whether parameter ``i`` had a gradient in the last step."""
        return i < len(self._had_grad) and self._had_grad[i]

    def name(self, p: nn.Parameter) -> str:
        return self.names.get(id(p), f"param{self.index.get(id(p), '?')}")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class ParamUpdateProbe(Probe):
    """Puts the update figures of ``params`` (``{name: Parameter}``) on its node's report row."""

    key = "param_updates"

    def __init__(self, table: UpdateTable, params: dict[str, nn.Parameter]) -> None:
        self.table = table
        self.params = params
        self.columns = _columns()

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        return {}

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        self.table.call = ctx.call  # which forward call the next optimizer step follows (host int)
        return None  # the figures come from the optimizer's hooks, not from the activation

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        host = self.table.host()
        if host is None:
            return {}
        per: dict[str, dict[str, Any]] = {}
        sq_upd = sq_w = 0.0
        best: tuple[float, str, int, float] = (0.0, "", -1, 0.0)
        for name, p in self.params.items():
            i = self.table.index.get(id(p))
            if i is None:
                continue
            norm, ratio, spike = host["norm"][i], host["ratio"][i], host["spike"][i]
            per[name] = {"update_norm": _num(norm), "update_ratio": _num(ratio), "update_spike": spike,
                         "update_spike_step": host["spike_step"][i] if spike > 0 else None}
            if _num(norm) is not None and _num(ratio) is not None and ratio > 0:
                sq_upd += norm * norm
                sq_w += (norm / ratio) ** 2
            if spike > best[0]:
                best = (spike, name, int(host["spike_step"][i]), host["spike_ratio"][i])
        skipped = bool(host["skipped"])
        for name, v in per.items():
            v["update_skipped"] = skipped and self.table.had_grad(self.table.index[id(self.params[name])])
        if not per or all(v["update_norm"] is None for v in per.values()):
            return {"param_updates": per} if per else {}
        out: dict[str, Any] = {"update_norm": sq_upd ** 0.5, "update_ratio": (sq_upd / sq_w) ** 0.5 if sq_w else None,
                               "update_spike": best[0], "param_updates": per, "update_skipped": skipped,
                               "history_updates": self._per_call()}
        if best[1]:
            out.update(update_spike_param=best[1], update_spike_step=best[2], update_spike_ratio=best[3])
        return out

    def _per_call(self) -> list[tuple[int, dict[str, Any]]]:
        """``[(forward call, figures), ...]``: each recent optimizer step's update of this node's
        parameters, under the forward call whose gradients it applied — the flight recorder's
        ``Report.history`` merges them into that call's entry for this node."""
        out = []
        for _step, call, norms, ratios, skipped in self.table.per_step():
            if call < 0:
                continue
            per: dict[str, Any] = {}
            sq_upd = sq_w = 0.0
            for name, p in self.params.items():
                i = self.table.index.get(id(p))
                norm = None if i is None else norms[i]
                if i is None or norm is None:
                    continue
                ratio = ratios[i]
                per[name] = {"update_norm": norm, "update_ratio": ratio}
                sq_upd += norm * norm
                if ratio is not None and ratio > 0:
                    sq_w += (norm / ratio) ** 2
            if per:
                out.append((call, {"update_norm": sq_upd ** 0.5, "update_ratio": (sq_upd / sq_w) ** 0.5 if sq_w else
                                   (0.0 if skipped else None), "update_skipped": skipped, "param_updates": per}))
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> "ParamUpdateProbe":
        return self  # a copy of the model still reports the one live optimizer's steps


def _num(v: Any) -> float | None:
    return None if v is None or v != v else float(v)


class ParamUpdates(Pass):
    """Per-parameter update norm and update/weight ratio of every ``optimizer`` step (no sync).

    Args:
        optimizer: the ``torch.optim.Optimizer`` (or ``fxdebug.guard`` of one) that trains the model.
        where: limit the watched parameters to those of the selected modules / nodes.

    See the module docstring for the figures and the ``update_spike`` finding.
    """

    name = "param-updates"
    observe_only = True

    def __init__(self, optimizer: Any, *, where: fxdebug.authoring.Where = None) -> None:
        super().__init__(where=where)
        inner = getattr(optimizer, "optimizer", optimizer)  # fxdebug.guard(...) wraps one
        if not isinstance(inner, torch.optim.Optimizer):
            raise fxdebug.authoring.Options(self).error(
                "optimizer", optimizer, "a torch.optim.Optimizer (or the fxdebug.guard that wraps one)")
        self.table = UpdateTable(inner)

    def _selects(self, node: Node) -> bool:
        covers = getattr(self.where, "covers", None)  # outputs_of("layer1"): the modules themselves
        if covers is not None:
            return bool(covers(module_path(node)))
        return self.where is None or matches(self.where, node)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per parameter of the optimizer, keyed by its name (``param``), in group order:
        ``group``, ``update_norm``, ``update_ratio``, ``update_spike``, ``update_spike_step`` (syncs once)."""
        host = self.table.host()
        groups = {id(p): gi for gi, g in enumerate(self.table.optimizer.param_groups) for p in g["params"]}
        out = []
        for i, p in enumerate(self.table.params):
            row: dict[str, Any] = {"param": self.table.name(p), "group": groups.get(id(p))}
            if host is not None:
                row.update(update_norm=_num(host["norm"][i]), update_ratio=_num(host["ratio"][i]),
                           update_spike=host["spike"][i],
                           update_spike_step=host["spike_step"][i] if host["spike"][i] > 0 else None,
                           update_skipped=bool(host["skipped"]) and self.table.had_grad(i))
            out.append(row)
        return out

    def history(self) -> dict[str, list[float | None]]:
        """``{parameter name: its update ratios of the last (up to) 64 steps, oldest first}``
        (``None`` for a step it had no gradient in); reads the device ring once."""
        got = self.table.ratios()
        if got is None:
            return {}
        ring, n = got
        recent = ring[:, WINDOW - n:].cpu()
        return {self.table.name(p): [_num(v) for v in recent[i].tolist()] for i, p in enumerate(self.table.params)}

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        tracked = set(self.table.index)
        for name, p in gm.named_parameters():
            if id(p) in tracked:
                self.table.names.setdefault(id(p), name)
        groups: dict[Node, dict[str, nn.Parameter]] = {}
        seen: set[int] = set()
        for node in list(gm.graph.nodes):
            if is_instrumentation(node) or not self._selects(node):
                continue
            params: dict[str, nn.Parameter] = {}
            host: Node | None = None
            if node.op == "call_module" and not str(node.target).startswith("fxdebug."):
                try:
                    module = gm.get_submodule(str(node.target))
                except AttributeError:
                    continue
                params = {f"{node.target}.{k}": v for k, v in module.named_parameters()}
                host = node
            elif node.op == "get_attr":
                value = fxdebug.authoring.get_attr(gm, str(node.target))
                if isinstance(value, nn.Parameter):
                    params = {str(node.target): value}
                    users = [u for u in node.users if not is_instrumentation(u)]
                    host = users[0] if users else None
            params = {k: p for k, p in params.items() if id(p) in tracked and id(p) not in seen}
            if not params or host is None:
                continue
            seen.update(id(p) for p in params.values())
            groups.setdefault(host, {}).update(params)
        added = [ctx.observe(host, ParamUpdateProbe(self.table, params)) for host, params in groups.items()]
        return PassResult(gm, added=[a for a in added if a is not None])
