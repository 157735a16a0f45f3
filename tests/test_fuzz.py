"""Property tests over random models (``tests/fuzz_models.py``): fxdebug never changes what a
model computes unless asked to, and never touches the model it was given.

CI runs a bounded number of examples per property (``FXDEBUG_FUZZ_EXAMPLES``, default 12 for
each of the three properties here, so about 36 models plus shrinking); set
``FXDEBUG_FUZZ_EXAMPLES=2000`` (or ``FXDEBUG_SLOW=1`` for 500) to run thousands locally.
"""

from __future__ import annotations

import atexit
import collections
import copy
import json
import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import fxdebug
from fxdebug.passes import DeviceCheck, Fuse, NaNCheck, PruneMasks, ShapeAssert, StatCollector, SwapActivation
from fuzz_models import FAITHFUL_OPS, RELU_FORMS, ModelSpec, _scaled, build, flat_tensors, model_specs

_DEFAULT = 500 if os.environ.get("FXDEBUG_SLOW") else 12
EXAMPLES = int(os.environ.get("FXDEBUG_FUZZ_EXAMPLES", _DEFAULT))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("FXDEBUG_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True, database=None,
                phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])

# What the generated models exercised; FXDEBUG_FUZZ_STATS=path writes it out at exit.
STATS: collections.Counter[str] = collections.Counter()
if os.environ.get("FXDEBUG_FUZZ_STATS"):
    atexit.register(lambda: open(os.environ["FXDEBUG_FUZZ_STATS"], "w").write(json.dumps(STATS, indent=1)))


# -- a small observe-only pass of our own, so the properties hold without the pass library ------
class SumProbe(fxdebug.authoring.Probe):
    """Counts calls and sums values, in float64, forward and backward."""

    key = "fuzz-sum"
    grads = True

    def init_state(self, x: Tensor, phase: str) -> dict[str, Tensor]:
        return {"sum": torch.zeros((), dtype=torch.float64, device=x.device),
                "n": torch.zeros((), dtype=torch.int64, device=x.device)}

    def update(self, state: dict[str, Tensor], r: fxdebug.authoring.Reductions, ctx: fxdebug.authoring.ObservationContext) -> None:
        state["sum"] += r["sum"].to(torch.float64)
        state["n"] += 1

    def summary(self, state: dict[str, Tensor], phase: str) -> dict[str, Any]:
        return {"fuzz_sum": float(state["sum"]), "fuzz_n": int(state["n"])}


class WatchAll(fxdebug.Pass):
    name = "fuzz-watch"
    observe_only = True

    def run(self, gm: Any, ctx: fxdebug.PassContext) -> fxdebug.PassResult:
        added = [ctx.observe(n, SumProbe()) for n in ctx.nodes(gm, self.where, float_outputs=True)]
        return fxdebug.PassResult(gm, added=[a for a in added if a is not None])


def observe_passes() -> list[fxdebug.Pass]:
    return [WatchAll(), ShapeAssert(), NaNCheck(backward=True), StatCollector(grads=True), DeviceCheck()]


# -- what "the model's state" is ------------------------------------------------------------------
def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything about ``model`` an instrumenting tool must leave alone, copied."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "ids": {k: id(v) for k, v in model.state_dict(keep_vars=True).items()},
        "modules": [(name, type(m), id(m), m.training) for name, m in model.named_modules()],
        "children": {name: list(m._modules) for name, m in model.named_modules()},
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "grads": {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()},
        "dict_keys": sorted(model.__dict__),
        "plain": [{k: v for k, v in vars(m).items() if isinstance(v, (bool, int, float, str)) and k != "training"}
                  for m in model.modules()],  # Python counters (self.calls) included
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["ids"] == b["ids"] and a["modules"] == b["modules"] and a["children"] == b["children"]
    assert a["requires_grad"] == b["requires_grad"] and a["dict_keys"] == b["dict_keys"]
    assert a["plain"] == b["plain"], "a Python attribute of the model changed"
    for k, v in a["state"].items():
        assert v.dtype == b["state"][k].dtype and torch.equal(v, b["state"][k]), f"state '{k}' changed"
    for k, g in a["grads"].items():
        h = b["grads"][k]
        assert (g is None) == (h is None) and (g is None or torch.equal(g, h)), f"grad of '{k}' changed"


def assert_same_values(model: nn.Module, ref: nn.Module) -> None:
    """``model`` and ``ref`` (a deepcopy run identically) hold bitwise-equal params, grads, buffers."""
    ref_params = dict(ref.named_parameters())
    for k, p in model.named_parameters():
        q = ref_params[k]
        assert torch.equal(p, q), f"parameter '{k}' differs"
        assert (p.grad is None) == (q.grad is None), f"grad of '{k}': {p.grad is None} vs {q.grad is None}"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"grad of '{k}' differs"
    ref_bufs = dict(ref.named_buffers())
    for k, b in model.named_buffers():
        assert torch.equal(b, ref_bufs[k]), f"buffer '{k}' differs"
    assert [m.training for m in model.modules()] == [m.training for m in ref.modules()]


def run_step(module: nn.Module, x: Tensor, seed: int) -> tuple[Any, Tensor | None]:
    """One forward and backward from a fixed RNG state; returns the output and the input grad."""
    x = x.clone().requires_grad_(x.is_floating_point())
    torch.manual_seed(seed)
    out = module(x)
    tensors = [t for t in flat_tensors(out) if t.is_floating_point() and t.requires_grad]
    if tensors:
        loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view(t.shape)).sum() for t in tensors)
        loss.backward()
    return out, x.grad


def assert_outputs_equal(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_outputs_equal(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_outputs_equal(u, v)
    else:
        assert a == b


def check_observe_only(spec: ModelSpec, train: bool, passes: list[fxdebug.Pass]) -> fxdebug.Instrumented:
    STATS["models"] += 1
    STATS.update(f"op:{op}" for op in spec.ops())
    STATS[f"out:{spec.out_format}"] += 1
    model = build(spec).train(train)
    x = spec.example()
    ref = copy.deepcopy(model)
    before = snapshot(model)
    rng = torch.get_rng_state()
    dbg = fxdebug.instrument(model, passes=passes, example_inputs=(x,))
    assert torch.equal(torch.get_rng_state(), rng), "instrument() consumed the global RNG"
    assert_same_state(before, snapshot(model))
    # the generated models trace whole: symbolic on the snapshot chain, else the live default
    assert dbg.trace_info.frontend in ("symbolic", "dynamo") and not dbg.trace_info.auto_leaves
    assert list(dbg.state_dict()) == list(model.state_dict())
    for step in range(2):
        out_ref, gx_ref = run_step(ref, x, spec.seed + step)
        out, gx = run_step(dbg, x, spec.seed + step)
        assert_outputs_equal(out, out_ref)
        assert (gx is None and gx_ref is None) or torch.equal(gx, gx_ref)
        assert_same_values(model, ref)
    return dbg


@FUZZ
@given(spec=model_specs(), train=st.booleans())
def test_observe_only_passes_are_bitwise_transparent(spec: ModelSpec, train: bool) -> None:
    dbg = check_observe_only(spec, train, observe_passes())
    report = dbg.report()
    assert report.calls == 2
    for row in report.rows:
        if "fuzz_n" in row:
            assert row["fuzz_n"] == row["calls"] == 2, row


@FUZZ
@given(spec=model_specs())
def test_watched_sums_match_an_eager_recomputation(spec: ModelSpec) -> None:
    """What the probe recorded for the last node equals what the plain model computes."""
    model = build(spec).eval()
    x = spec.example()
    dbg = fxdebug.instrument(model, passes=[WatchAll()], example_inputs=(x,))
    with torch.no_grad():
        dbg(x)
        dbg(x)
        outs = [t for t in flat_tensors(model(x)) if t.is_floating_point()]
    # the forward's first returned value is always the newest step's value
    graph = list(dbg.parts().values())[-1].graph  # the graph that ran (a live module: the no_grad capture)
    last = [n for n in graph.nodes if n.op == "output"][0].all_input_nodes[0]
    row = dbg.report().row(last.name)
    expected = 2 * outs[0].sum(dtype=torch.float64 if outs[0].dtype == torch.float64 else torch.float32).double()
    assert row["fuzz_n"] == 2
    assert row["fuzz_sum"] == pytest.approx(float(expected), rel=1e-5, abs=1e-4)


@FUZZ
@given(spec=model_specs())
def test_instrumenting_twice_composes(spec: ModelSpec) -> None:
    """instrument(instrument(m)) watches each node once and still computes the model bitwise."""
    model = build(spec).eval()
    x = spec.example()
    once = fxdebug.instrument(model, passes=[WatchAll()], example_inputs=(x,))
    twice = fxdebug.instrument(once, passes=[WatchAll()], example_inputs=(x,))
    assert len(twice.observers()) == len(once.observers())
    assert sum(1 for n in twice.graph.nodes if fxdebug.authoring.is_instrumentation(n)) == \
        sum(1 for n in once.graph.nodes if fxdebug.authoring.is_instrumentation(n))
    with torch.no_grad():
        assert_outputs_equal(twice(x), model(x))
    assert twice.report().calls == 1 and once.report().calls == 0


# -- faithful in both modes, whatever the forward does ----------------------------------------------
def _counters(model: nn.Module) -> list[Any]:
    return [m.__dict__.get("calls") for m in model.modules()]


@FUZZ
@given(spec=model_specs(faithful=True), first=st.booleans(),
       frontend=st.sampled_from(["auto", "auto", "symbolic", "export", "subtrees"]))
def test_instrumented_equals_the_model_in_both_modes(spec: ModelSpec, first: bool, frontend: str) -> None:
    """Custom autograd.Functions, grad-mode/autocast regions, training branches, buffer reassignment,
    Python counters and hooks: outputs, every gradient and buffers equal the model's in both modes,
    switched after instrumenting, and instrument() leaves the model exactly as it was. A frontend
    that cannot capture a construct faithfully refuses with a TraceError (then "auto" is used)."""
    STATS["faithful_models"] += 1
    STATS.update(f"faithful-op:{op}" for op in spec.ops() if op in FAITHFUL_OPS)
    STATS.update(f"root:{h}" for h in spec.root_hooks + (("counter",) if spec.root_counter else ()))
    model = build(spec).train(first)
    x = spec.example()
    ref = copy.deepcopy(model)
    before = snapshot(model)
    rng = torch.get_rng_state()
    try:
        dbg = fxdebug.instrument(model, passes=observe_passes(), example_inputs=(x,), frontend=frontend)
    except fxdebug.TraceError as exc:
        assert frontend in ("symbolic", "export"), f"{frontend} refused: {exc}"
        assert_same_state(before, snapshot(model))
        STATS[f"refused:{frontend}"] += 1
        dbg = fxdebug.instrument(model, passes=observe_passes(), example_inputs=(x,))
    assert torch.equal(torch.get_rng_state(), rng), "instrument() consumed the global RNG"
    assert_same_state(before, snapshot(model))
    STATS[f"frontend:{dbg.trace_info.frontend}"] += 1
    for k, mode in enumerate((first, not first, first)):
        dbg.train(mode)  # the instrumented module alone is switched; the model's root flag follows for the check
        model.training = mode
        ref.train(mode)
        out_ref, gx_ref = run_step(ref, x, spec.seed + k)
        logged = len(model.hook_log)
        out, gx = run_step(dbg, x, spec.seed + k)
        assert len(model.hook_log) == logged + ("log" in spec.root_hooks), "the root's hook did not run once"
        assert_outputs_equal(out, out_ref)
        assert (gx is None and gx_ref is None) or torch.equal(gx, gx_ref)
        assert_same_values(model, ref)
        assert _counters(model) == _counters(ref)
    if spec.seed % 3 == 0:  # fxdebug.verify agrees, and leaves the model as the steps above left it
        after = snapshot(model)
        result = fxdebug.verify(dbg, x)
        assert result.ok, str(result)
        assert_same_state(after, snapshot(model))
        STATS["verified"] += 1


# -- transform passes: exact where the change is meant to be exact ---------------------------------
def _compare_run(dbg: nn.Module, ref: nn.Module, x: Tensor, seed: int) -> None:
    out_ref, gx_ref = run_step(ref, x, seed)
    out, gx = run_step(dbg, x, seed)
    assert_outputs_equal(out, out_ref)
    assert (gx is None and gx_ref is None) or torch.equal(gx, gx_ref)


@FUZZ
@given(spec=model_specs(), train=st.booleans(), slope=st.sampled_from([0.01, 0.2]))
def test_swap_activation_equals_a_hand_made_leaky_copy(spec: ModelSpec, train: bool, slope: float) -> None:
    swap = SwapActivation(negative_slope=slope)
    model = build(spec).train(train)
    leaky = build(spec, leaky=slope).train(train)
    before = snapshot(model)
    dbg = fxdebug.instrument(model, passes=[swap], example_inputs=(spec.example(),))
    assert_same_state(before, snapshot(model))
    assert not any(fxdebug.authoring.is_relu(n, dbg) for n in dbg.graph.nodes), "a ReLU form was not swapped"
    _compare_run(dbg, leaky, spec.example(), spec.seed)
    assert_same_values(model, leaky)
    STATS["relus_swapped"] += sum(op in RELU_FORMS for op in spec.ops())


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Fuse's stated tolerance: rtol 1e-4 / atol 1e-4 in float32, 1e-10 in float64."""
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}


@FUZZ
@given(spec=model_specs(fusable=True))
def test_fuse_matches_in_eval_within_tolerance(spec: ModelSpec) -> None:
    fuse = Fuse()
    model = build(spec).eval()
    x = spec.example()
    before = snapshot(model)
    dbg = fxdebug.instrument(model, passes=[fuse], example_inputs=(x,))
    assert_same_state(before, snapshot(model))
    with torch.no_grad():
        got, want = flat_tensors(dbg(x)), flat_tensors(model(x))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **_tolerance(spec.dtype))
    STATS["fused_pairs"] += sum(n.startswith("fused ") for r in dbg.pass_results for n in r.notes)


@FUZZ
@given(spec=model_specs(), train=st.booleans(), amount=st.sampled_from([0.0, 0.3, 0.5, 0.9]),
       structured=st.sampled_from([False, False, "channels"]))
def test_prune_masks_equals_the_model_with_those_weights_zeroed(spec: ModelSpec, train: bool, amount: float,
                                                                structured: Any) -> None:
    prune = PruneMasks(amount=amount, structured=structured)
    from fxdebug.passes.prune import Masked, sparsity

    model = build(spec).train(train)
    x = spec.example()
    ref = copy.deepcopy(model)
    before = snapshot(model)
    dbg = fxdebug.instrument(model, passes=[prune], example_inputs=(x,))
    assert_same_state(before, snapshot(model))
    masked = [m for m in dbg.modules() if isinstance(m, Masked)]
    masks: dict[str, Tensor] = {}
    with torch.no_grad():
        for m in masked:
            for name in m.names:
                masks[f"{m.path}.{name}" if m.path else name] = m.mask(name)
                getattr(ref.get_submodule(m.path), name).mul_(m.mask(name))
    stats = sparsity(dbg)
    if stats["weights"] and not structured:
        assert stats["global"] == round(amount * stats["weights"]) / stats["weights"]
    _compare_run(dbg, ref, x, spec.seed)
    ref_params = dict(ref.named_parameters())
    for k, p in model.named_parameters():
        want = ref_params[k].grad
        if want is not None and k in masks:
            want = want * masks[k]
        assert (p.grad is None) == (want is None) and (want is None or torch.equal(p.grad, want)), k
    STATS["pruned_layers"] += len(masked)
    STATS.update(f"prune-op:{op}" for op in spec.ops())


# -- after instrument: the model keeps changing ------------------------------------------------------
MUTATIONS = ("replace", "load_state_dict", "add_hook", "remove_hook", "model_train", "model_eval", "keyword",
             "batch")


def _mutate(kind: str, model: nn.Module, ref: nn.Module, handles: list[Any], k: int) -> dict[str, Any]:
    """Apply one change to ``model`` and the same change to ``ref``; returns extra call keywords."""
    children = [n for n, m in model.named_children() if n != "unused" and any(True for _ in m.parameters())]
    if kind == "replace" and children:
        name = children[k % len(children)]
        new = copy.deepcopy(getattr(model, name))
        with torch.no_grad():
            for p in new.parameters():
                p.mul_(0.5)
        setattr(model, name, new)
        setattr(ref, name, copy.deepcopy(new))
    elif kind == "load_state_dict":
        with torch.random.fork_rng():
            torch.manual_seed(k)
            sd = {n: (v * 0.9 + 0.05 * torch.rand_like(v)) if v.is_floating_point() else v
                  for n, v in model.state_dict().items()}
        model.load_state_dict(sd)
        ref.load_state_dict(sd)
    elif kind == "add_hook":
        names = [n for n, _ in model.named_modules() if n and not n.startswith("unused")]
        if names:
            name = names[k % len(names)]
            hook = lambda m, args, out: _scaled(out, 1.25)  # noqa: E731
            handles.append((model.get_submodule(name).register_forward_hook(hook),
                            ref.get_submodule(name).register_forward_hook(hook)))
    elif kind == "remove_hook" and handles:
        for h in handles.pop():
            h.remove()
    elif kind in ("model_train", "model_eval"):
        model.train(kind == "model_train")  # on the model, not on the instrumented module
        ref.train(kind == "model_train")
    elif kind == "keyword":
        return {"scale": 0.5 + 0.25 * (k % 3)}
    return {}


def _keyword_step(module: nn.Module, x: Tensor, seed: int, kwargs: dict[str, Any]) -> tuple[Any, Tensor | None]:
    x = x.clone().requires_grad_(x.is_floating_point())
    torch.manual_seed(seed)
    out = module(x, **kwargs)
    tensors = [t for t in flat_tensors(out) if t.is_floating_point() and t.requires_grad]
    if tensors:
        sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view(t.shape)).sum() for t in tensors).backward()
    return out, x.grad


def _takes(model: nn.Module, x: Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether the model runs on this call at all (tried on a copy: the model itself is not run)."""
    with torch.random.fork_rng(), torch.no_grad():
        try:
            copy.deepcopy(model)(x.clone(), **kwargs)
        except Exception:  # noqa: BLE001 - any failure: the model does not take this call
            return False
    return True


@FUZZ
@given(spec=model_specs(faithful=True), frontend=st.sampled_from(["auto", "symbolic", "export", "subtrees"]),
       mutations=st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=4))
def test_after_instrument_mutations_never_give_a_stale_answer(spec: ModelSpec, frontend: str,
                                                              mutations: list[str]) -> None:
    """The model changes after instrument(): a submodule replaced, a checkpoint loaded, hooks added and
    removed, modes switched on the model, a new keyword, another batch size. Every call of the
    instrumented module equals the model's (outputs, input gradient, every parameter's gradient and
    buffer), or raises a typed fxdebug error; after a refusal the model is instrumented again."""
    model = build(spec, keyword=True).eval()
    ref = copy.deepcopy(model)
    x = spec.example()
    try:
        dbg = fxdebug.instrument(model, passes=observe_passes(), example_inputs=(x,), frontend=frontend)
    except fxdebug.TraceError:
        assert frontend in ("symbolic", "export")
        frontend = "auto"
        dbg = fxdebug.instrument(model, passes=observe_passes(), example_inputs=(x,))
    handles: list[Any] = []
    for k, kind in enumerate(mutations):
        STATS[f"mutation:{kind}"] += 1
        kwargs = _mutate(kind, model, ref, handles, k)
        inp = spec.example(batch=spec.in_shape[0] + 1) if kind == "batch" else x
        if not _takes(ref, inp, kwargs):  # the model itself does not take this call (a shape it fixes)
            continue
        try:  # the instrumented module first: a refusal must come before anything runs
            out, gx = _keyword_step(dbg, inp, spec.seed + k, kwargs)
        except fxdebug.FxDebugError:  # a typed refusal; instrument the model as it is now and compare that
            STATS[f"refused-after:{kind}"] += 1
            again = fxdebug.Inputs(inp, **kwargs)
            try:
                dbg = fxdebug.instrument(model, passes=observe_passes(), example_inputs=again, frontend=frontend)
            except fxdebug.TraceError:  # this frontend refuses the model as it is now (a hooked submodule)
                assert frontend in ("symbolic", "export"), frontend
                frontend = "auto"
                dbg = fxdebug.instrument(model, passes=observe_passes(), example_inputs=again)
            out, gx = _keyword_step(dbg, inp, spec.seed + k, kwargs)
        out_ref, gx_ref = _keyword_step(ref, inp, spec.seed + k, kwargs)
        assert_outputs_equal(out, out_ref)
        assert (gx is None and gx_ref is None) or torch.equal(gx, gx_ref)
        assert_same_values(model, ref)
