"""fxdebug.guard: a non-finite step changes no weight and no optimizer state, without a host sync."""

from __future__ import annotations

import collections
import copy
import importlib
from typing import Any, Callable

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.runtime import kernel
from fxdebug.training import restore
from fxdebug.passes import NaNCheck
from syncs import CountSyncs

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}
BAD = 3  # the planted batch


class Net(nn.Module):
    """An MLP with a side branch that can go NaN without touching any gradient (detached input)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = torch.log(x.detach()[:, :1] + 10)  # NaN only when an input is below -10
        return self.fc2(torch.relu(self.fc1(x))) + torch.nan_to_num(side, nan=0.0)


def batches(n: int = 7, bad: int | None = BAD, value: float = float("nan")) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(8, 6, generator=gen) for _ in range(n)]
    if bad is not None:
        out[bad] = out[bad].clone()
        out[bad][2, 0] = value
    return out


def snapshot(model: nn.Module, opt: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} != {b}"


def train(kind: str, data: list[torch.Tensor], *, guarded: bool, skip: int | None = None, dbg_passes: Any = None,
          check_bad: bool = False) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[kind](model.parameters())
    run: nn.Module = model
    dbg = None
    if dbg_passes is not None:
        dbg = run = fxdebug.instrument(model, passes=dbg_passes, example_inputs=(data[0],))
    g = fxdebug.guard(opt, dbg=dbg) if guarded else opt
    for i, x in enumerate(data):
        if i == skip:
            continue
        before = snapshot(model, opt) if i == BAD and check_bad else None
        run(x).square().mean().backward()
        g.step()
        g.zero_grad()
        if before is not None:
            after = snapshot(model, opt)
            assert_bitwise(before[0], after[0], f"{kind}: weights after the bad step")
            assert_bitwise(before[1], after[1], f"{kind}: optimizer state after the bad step")
    return model, g


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_nan_batch_changes_nothing_and_the_run_continues_as_if_skipped(kind: str) -> None:
    data = batches()
    model, g = train(kind, data, guarded=True, check_bad=True)
    assert int(g.skipped) == 1
    assert g.skipped_steps == [{"step": BAD, "origin": None}]
    ref, ref_opt = train(kind, data, guarded=False, skip=BAD)  # the plain optimizer, never shown the batch
    assert_bitwise(ref.state_dict(), model.state_dict(), f"{kind}: weights")
    assert_bitwise(ref_opt.state_dict(), g.state_dict(), f"{kind}: optimizer state")


@pytest.mark.parametrize("kind", ["sgd", "sgd-fused", "adam-foreach", "adamw-fused"])
def test_a_bad_first_step_leaves_the_optimizer_as_if_it_never_ran(kind: str) -> None:
    data = batches(4, bad=0, value=float("inf"))
    torch.manual_seed(0)
    model = Net()
    g = fxdebug.guard(OPTIMIZERS[kind](model.parameters()))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    model(data[0]).square().mean().backward()
    g.step()
    g.zero_grad()
    assert_bitwise(init, model.state_dict(), "weights")
    for x in data[1:]:
        model(x).square().mean().backward()
        g.step()
        g.zero_grad()
    ref, ref_opt = train(kind, data, guarded=False, skip=0)
    assert_bitwise(ref.state_dict(), model.state_dict(), "weights")
    assert_bitwise(ref_opt.state_dict()["state"], g.state_dict()["state"], "state")



def syncs_in_step(opt: Any, model: nn.Module, x: torch.Tensor) -> int:
    model(x).square().mean().backward()
    with CountSyncs() as counter:
        opt.step()
    opt.zero_grad()
    return counter.syncs


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_guard_adds_no_host_sync_to_step(kind: str) -> None:
    data = batches()
    torch.manual_seed(0)
    model = Net()
    plain = OPTIMIZERS[kind](model.parameters())
    own = [syncs_in_step(plain, model, x) for x in data[:2]]  # non-fused Adam reads its own CPU step count
    g = fxdebug.guard(OPTIMIZERS[kind](model.parameters()))
    guarded = [syncs_in_step(g, model, x) for x in data[:BAD + 1]]
    assert guarded == [own[-1]] * len(guarded)
    if "fused" in kind or "sgd" in kind:
        assert guarded == [0] * len(guarded)


@pytest.mark.parametrize("kind", ["sgd-foreach", "adam", "adamw-fused"])
def test_with_grad_scaler_the_step_is_sync_free_and_matches_the_scaler_alone(kind: str) -> None:
    data = batches(value=float("inf"))

    def run(guarded: bool) -> tuple[nn.Module, Any, Any, list[int]]:
        torch.manual_seed(0)
        model = Net()
        opt = OPTIMIZERS[kind](model.parameters())
        g = fxdebug.guard(opt) if guarded else opt
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        syncs = []
        for i, x in enumerate(data):
            before = snapshot(model, opt) if i == BAD else None
            scaler.scale(model(x).square().mean()).backward()
            with CountSyncs() as counter:
                scaler.step(g)
            syncs.append(counter.syncs)
            scaler.update()
            g.zero_grad()
            if before is not None:
                assert_bitwise(before[0], model.state_dict(), "weights after the bad step")
                assert_bitwise(before[1]["state"], opt.state_dict()["state"], "state after the bad step")
        return model, opt, scaler, syncs

    model, opt, scaler, syncs = run(True)
    ref, ref_opt, ref_scaler, _ = run(False)
    assert_bitwise(ref.state_dict(), model.state_dict(), "weights")
    assert_bitwise(ref_opt.state_dict()["state"], opt.state_dict()["state"], "state")
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** 9
    if "fused" in kind or "sgd" in kind:
        assert syncs == [0] * len(data)


def test_with_dbg_a_nan_in_a_watched_node_skips_the_step_and_names_the_node() -> None:
    data = batches(value=-100.0)  # finite input: only the detached side branch goes NaN
    plain_model, plain = train("adamw-foreach", data, guarded=True)
    assert int(plain.skipped) == 0  # gradients stay finite: without dbg the step is taken
    model, g = train("adamw-foreach", data, guarded=True, dbg_passes=[NaNCheck()], check_bad=True)
    assert int(g.skipped) == 1
    [skip] = g.skipped_steps
    assert skip["step"] == BAD and skip["origin"] == "log"
    rep = g.report()
    assert rep.first_nonfinite == "log"
    assert rep.skipped_steps == g.skipped_steps
    assert any("step 3 skipped" in n and "log" in n for n in rep.notes)
    ref, ref_opt = train("adamw-foreach", data, guarded=False, skip=BAD)
    assert_bitwise(ref.state_dict(), model.state_dict(), "weights")


def test_the_guard_keeps_the_optimizer_face() -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = fxdebug.guard(opt)
    assert g.param_groups is opt.param_groups and g.state is opt.state and g.defaults is opt.defaults
    extra = nn.Parameter(torch.zeros(3))
    g.add_param_group({"params": [extra], "lr": 0.5})
    assert opt.param_groups[-1]["lr"] == 0.5
    model(batches(1, bad=None)[0]).sum().backward()
    extra.grad = torch.ones(3)
    g.step()
    sd = g.state_dict()
    g2 = fxdebug.guard(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g2.add_param_group({"params": [extra]})
    g2.load_state_dict(sd)
    assert_bitwise(sd["state"], g2.state_dict()["state"])
    assert fxdebug.guard(g) is g
    with pytest.raises(fxdebug.UsageError, match="torch.optim.Optimizer"):
        fxdebug.guard(list(model.parameters()))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["adamw-fused", "sgd"])
def test_with_dbg_the_step_is_still_sync_free(kind: str) -> None:
    data = batches(value=-100.0)
    torch.manual_seed(0)
    model = Net()
    dbg = fxdebug.instrument(model, passes=[NaNCheck()], example_inputs=(data[0],))
    g = fxdebug.guard(OPTIMIZERS[kind](model.parameters()), dbg=dbg)
    syncs = [syncs_in_step(g, dbg, x) for x in data]
    assert syncs == [0] * len(data)
    assert int(g.skipped) == 1 and g.skipped_steps[0]["origin"] == "log"


def test_a_learning_rate_scheduler_takes_the_guard() -> None:
    model = Net()
    g = fxdebug.guard(torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(g, step_size=1, gamma=0.5)
    for x in batches(3, bad=1):
        model(x).sum().backward()
        g.step()
        g.zero_grad()
        sched.step()
    assert g.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    assert int(g.skipped) == 1


class Replacing(torch.optim.Optimizer):
    """A hand-written momentum optimizer that replaces its state tensors instead of updating them in place."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["m"] = st["m"] * 0.9 + p.grad if "m" in st else p.grad.clone()
                p.sub_(group["lr"] * st["m"])


def test_any_optimizer_even_one_that_replaces_its_state_tensors() -> None:
    data = batches()

    def run(guarded: bool, skip: int | None) -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = Net()
        opt: Any = Replacing(model.parameters())
        g = fxdebug.guard(opt) if guarded else opt
        for i, x in enumerate(data):
            if i == skip:
                continue
            before = snapshot(model, opt) if i == BAD and guarded else None
            model(x).square().mean().backward()
            g.step()
            g.zero_grad()
            if before is not None:
                assert_bitwise(before, snapshot(model, opt), "after the bad step")
        return model, opt

    model, opt = run(True, None)
    ref, ref_opt = run(False, BAD)
    assert_bitwise(ref.state_dict(), model.state_dict(), "weights")
    assert_bitwise(ref_opt.state_dict()["state"], opt.state_dict()["state"], "state")
    model2 = Net()
    g = fxdebug.guard(Replacing(model2.parameters()))
    for x in data:
        model2(x).sum().backward()
        g.step()
        g.zero_grad()
    n = len(list(model2.parameters()))
    assert n <= len(g._buffers) <= 2 * n  # copies of the replaced state tensors are not kept alive step after step


def bit_patterns(dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` values of ``dtype`` drawn over its bits: NaNs with payloads, -0.0, subnormals, +-Inf."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    info = torch.iinfo(ints)
    bits = torch.randint(info.min, info.max, (n,), dtype=ints, generator=torch.Generator().manual_seed(n))
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), torch.finfo(dtype).tiny / 4], dtype=dtype)
    bits[: min(n, 6)] = special.view(ints)[: min(n, 6)]
    return bits.view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_conditional_copy_is_bit_exact_and_skips_on_the_flag(dtype: torch.dtype) -> None:
    sizes = [1, 5, 8, 17, 1000]  # vector body and scalar tail of the kernel
    src = [bit_patterns(dtype, n) for n in sizes]
    kept = [s.clone() for s in src]
    dst = [torch.randn(n, dtype=dtype) for n in sizes]
    before = [d.clone() for d in dst]
    scratch = [torch.empty(n, dtype=dtype) for n in sizes]
    with CountSyncs() as counter:
        restore._copy_if(dst, src, scratch, torch.ones(()))  # a good step: nothing moves
    assert_bitwise(before, dst, "skipped copy")
    restore._copy_if(dst, src, scratch, torch.zeros(()))  # a bad one: every bit copied
    assert_bitwise(kept, dst, "copy")
    assert_bitwise(kept, src, "source")  # only read
    assert counter.syncs == 0


@pytest.mark.skipif(kernel.copy_plan_class() is None, reason="the C++ extension is not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_native_copy_plan_is_bit_exact_and_copies_only_on_the_flag(dtype: torch.dtype) -> None:
    sizes = [1, 5, 8, 17, 1000]
    live = [bit_patterns(dtype, n) for n in sizes] + [torch.tensor([True, False]), torch.arange(7)]
    kept = [t.clone() for t in live]
    copies = [torch.zeros_like(t) for t in live]
    plan = kernel.copy_plan_class()(live, copies)
    versions = [t._version for t in live + copies]
    with CountSyncs() as counter:
        plan.save(torch.zeros(()))  # a good step: nothing moves, no version changes
        plan.restore(torch.zeros(()))
    assert counter.syncs == 0 and [t._version for t in live + copies] == versions
    assert all(not bool(c.any()) for c in copies)
    plan.save(torch.ones(()))  # a bad step: every byte saved...
    assert_bitwise(kept, copies, "saved")
    for t in live:
        t.zero_()
    plan.restore(torch.ones(()))  # ...and put back
    assert_bitwise(kept, live, "restored")
    with pytest.raises(RuntimeError, match="contiguous dense CPU"):
        kernel.copy_plan_class()([torch.zeros(4, 4).t()], [torch.zeros(4, 4)])


class RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []  # (op, elements of its first tensor-list or tensor argument)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        first = args[0] if args else None
        size = sum(t.numel() for t in first if isinstance(t, torch.Tensor)) if isinstance(first, (list, tuple)) else getattr(first, "numel", lambda: 0)()
        self.ops.append((str(func.overloadpacket.__name__), size))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["sgd", "adam-foreach"])
def test_a_good_step_makes_no_pass_over_the_parameters_beyond_the_optimizers_own(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(8, 16, generator=gen) for _ in range(3)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 4))  # more weights than the guard's own log
    opt = OPTIMIZERS[kind](model.parameters())
    g = fxdebug.guard(opt)
    for x in data[:2]:
        model(x).square().mean().backward()
        g.step()
        g.zero_grad()
    model(data[2]).square().mean().backward()
    with RecordOps() as plain:
        opt.step()  # what the optimizer does by itself (the state exists: no first-step ops)
    with RecordOps() as guarded:
        g.step()
    extra = list((collections.Counter(guarded.ops) - collections.Counter(plain.ops)).elements())
    n = sum(p.numel() for p in model.parameters())
    big = sorted({name for name, size in extra if size >= n and name not in ("_fused_sgd_", "any_nonfinite",
                                                                             "_amp_foreach_non_finite_check_and_unscale_")})
    assert big == [], f"{kind}: the guard passes over the parameters with {big}"
    # the conditional copy, before and after: on the CPU the extension's CopyPlan (no dispatched op),
    # else torch's fused SGD kernel
    native = g._plan is not None and bool(g._plan.native)
    assert native == (kernel.copy_plan_class() is not None)
    assert sum(1 for name, _ in extra if name == "_fused_sgd_") == (0 if native else 2)


def train_typed(kind: str, dtype: torch.dtype, data: list[torch.Tensor], *, guarded: bool,
                skip: int | None = None) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = OPTIMIZERS[kind](model.parameters())
    g = fxdebug.guard(opt) if guarded else opt
    for i, x in enumerate(data):
        if i == skip:
            continue
        before = snapshot(model, opt) if i == BAD and guarded else None
        model(x.to(dtype)).square().mean().backward()
        g.step()
        g.zero_grad()
        if before is not None:
            assert_bitwise(before, snapshot(model, opt), f"{kind} {dtype}: after the bad step")
    return model, opt


@pytest.mark.parametrize(("kind", "dtype"), [("sgd", torch.bfloat16), ("sgd", torch.float16), ("sgd", torch.float64),
                                           ("adam-foreach", torch.bfloat16), ("adam-foreach", torch.float64)])
def test_other_dtypes_are_restored_bitwise(kind: str, dtype: torch.dtype) -> None:
    """bfloat16/float16 take the copy-and-select path over 16-bit views; float64 the conditional copy."""
    data = batches()
    model, opt = train_typed(kind, dtype, data, guarded=True)
    ref, ref_opt = train_typed(kind, dtype, data, guarded=False, skip=BAD)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert_bitwise(ref.state_dict(), model.state_dict(), f"{kind} {dtype}: weights")
    assert_bitwise(ref_opt.state_dict()["state"], opt.state_dict()["state"], f"{kind} {dtype}: state")


def test_without_the_conditional_copy_kernel_the_guard_copies_every_step_and_stays_exact(monkeypatch: Any) -> None:

    def missing(*args: Any) -> None:
        raise NotImplementedError("no _fused_sgd_ kernel for this device")

    monkeypatch.setattr(restore, "_copy_if", missing)
    monkeypatch.setattr(kernel, "copy_plan_class", lambda: None)  # as without the C++ extension
    data = batches()
    model, g = train("adamw", data, guarded=True, check_bad=True)
    assert g._plan is not None and not g._plan.copies and g._plan.saved[0]  # the fallback path ran
    ref, ref_opt = train("adamw", data, guarded=False, skip=BAD)
    assert_bitwise(ref.state_dict(), model.state_dict(), "weights")
    assert_bitwise(ref_opt.state_dict(), g.state_dict(), "optimizer state")


@pytest.mark.parametrize("watch", [False, True])
def test_the_skip_count_and_log_stay_exact_across_ring_folds_and_mid_run_reads(monkeypatch: Any, watch: bool) -> None:
    guard_module = importlib.import_module("fxdebug.training.guard")  # (the package exports the function guard)
    monkeypatch.setattr(guard_module, "_RING", 3)  # the per-step flags fold into the count every 3 steps
    monkeypatch.setattr(guard_module, "_LOG", 4)  # and the log keeps the first 4 skipped steps
    bad = [1, 2, 5, 6, 7, 10]
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(8, 6, generator=gen) for _ in range(12)]
    for i in bad:
        data[i][1, 0] = -100.0 if watch else float("nan")  # -100: only the watched side branch goes NaN
    torch.manual_seed(0)
    model = Net()
    dbg = fxdebug.instrument(model, passes=[NaNCheck()], example_inputs=(data[0],)) if watch else None
    g = fxdebug.guard(OPTIMIZERS["sgd"](model.parameters()), dbg=dbg)
    syncs = []
    for i, x in enumerate(data):
        syncs.append(syncs_in_step(g, dbg if dbg is not None else model, x))  # a fold inside step() too
        if i == 4:  # a read between folds
            assert int(g.skipped) == 2 and [s["step"] for s in g.skipped_steps] == [1, 2]
    assert syncs == [0] * len(data)
    assert int(g.skipped) == len(bad)
    assert [s["step"] for s in g.skipped_steps] == bad[:4]
    assert [s["origin"] for s in g.skipped_steps] == (["log"] * 4 if watch else [None] * 4)
