"""One rule for every option of every built-in pass (issue 35, B11/B12): ``fxdebug.authoring.Options``.

The options are read from the passes' signatures, so a new option of a new pass is covered (or this
test names it): each flag refuses anything but True/False/1/0 (``NaNCheck(backward="no")`` used to
switch backward checks *on*), each number refuses bools, strings and NaN and keeps to its range,
each choice names its choices, each iterable refuses a bare scalar (``ShapeAssert(dynamic_dims=0)``
used to raise a raw ``TypeError``). Every refusal is a ``UsageError`` naming the pass, the option and
the value; a wrong kind of value is an ``ArgumentTypeError`` (a ``UsageError`` and a ``TypeError``).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import fxdebug
import fxdebug.passes as P
from fxdebug.authoring import Options

_OPT = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
REQUIRED = {  # the arguments a pass cannot be built without
    "Breakpoint": {"where": "fc"}, "Capture": {"nodes": ["fc"]}, "Freeze": {"where": "fc"}, "GradientScale": {"where": "fc", "factor": 2.0},
    "ParamUpdates": {"optimizer": _OPT}, "Precision": {"plan": ["fc"]}, "PruneMasks": {"amount": 0.5},
}
# options whose kind the annotation does not say alone: (good values, bad values)
SPECIAL = {
    ("Capture", "nodes"): (["fc", ["fc", "relu"], ("fc",)], [3, [3], ["fc", 1]]),
    ("Capture", "clone"): ([None, True, False, 1, 0], ["no", 0.5, 2]),
    ("StatCollector", "channel_dim"): ([None, "auto", 1, -1], ["x", 1.5, True]),
    ("StatCollector", "histograms"): ([True, False, 0, 1, 16], ["x", 1.5, -3]),
    ("PruneMasks", "structured"): ([False, None, "channels", 0], [True, "rows", 1.5]),
    ("PruneMasks", "norm"): ([1, 2], [3, "l1", 1.5]),
    ("Histograms", "range"): ([None, (0.0, 1.0), [-1, 1]], [(1.0, 0.0), (0.0,), 3, "01"]),
    ("Shadow", "dtype"): ([torch.float64, torch.float32], [torch.int32, "float64", None]),
    ("Precision", "dtype"): ([torch.float32, torch.bfloat16], [torch.int64, "float32", None]),
    ("Precision", "plan"): ([["fc"], ("fc", "relu")], ["fc", 3]),
    ("ParamUpdates", "optimizer"): ([_OPT], [None, "sgd", 3]),
}
FREE = {  # options that take any object by design (examples, a report, a batch), or a selection
    "where", "other_inputs", "report", "batch", "self",
}
CALLABLES = {"when", "action", "to", "loss_fn", "on_nonfinite"}
RANGES = [  # (pass, option, a value of the right kind outside what the option accepts)
    ("NaNCheck", "history", 0), ("Recorder", "history", 0), ("Histograms", "bins", 0), ("PruneMasks", "amount", 1.0),
    ("PruneMasks", "amount", -0.1), ("Fuse", "atol", -1e-3), ("Fuse", "rtol", -1.0), ("SwapActivation", "only_dead", 2.0),
    ("ExpertLoad", "experts", 0), ("NaNCheck", "mode", "rase"), ("PruneMasks", "scope", "all"),
    ("PruneMasks", "importance", "random"), ("GradientScale", "factor", math.nan),
]


def _options():
    for name in P.__all__:
        cls = getattr(P, name)
        for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            yield name, cls, param


def _kind(name: str, param: inspect.Parameter) -> str:
    ann = str(param.annotation).replace("'", "")
    if (name, param.name) in SPECIAL:
        return "special"
    if param.name in FREE:
        return "free"
    if param.name in CALLABLES:
        return "callable"
    return {"bool": "flag", "int": "int", "int | None": "int?", "float": "number", "float | None": "number?",
            "str": "choice", "Iterable[int]": "ints"}.get(ann, f"unknown ({ann})")


def _build(name: str, **options):
    kwargs = dict(REQUIRED.get(name, {}))
    kwargs.update(options)
    return getattr(P, name)(**kwargs)


def _refused(name: str, option: str, value) -> fxdebug.UsageError:
    with pytest.raises(fxdebug.UsageError) as info:
        _build(name, **{option: value})
    message = str(info.value)
    assert f"{name}({option}=" in message, message  # names the pass and the option
    assert repr(value)[:40] in message, message  # and the value
    assert info.value.pass_name == getattr(P, name).name
    return info.value


ALL = list(_options())


def test_every_option_of_every_pass_has_a_known_kind():
    unknown = [(n, p.name, _kind(n, p)) for n, _, p in ALL if _kind(n, p).startswith("unknown")]
    assert not unknown, f"options without a rule in this test (add them to SPECIAL or the kinds): {unknown}"


FLAGS = [(n, p.name) for n, _, p in ALL if _kind(n, p) == "flag"]
NUMBERS = [(n, p.name, _kind(n, p)) for n, _, p in ALL if _kind(n, p) in ("int", "int?", "number", "number?")]
CHOICES = [(n, p.name, p.default) for n, _, p in ALL if _kind(n, p) == "choice"]


def test_the_issue_cases():
    err = _refused("NaNCheck", "backward", "no")
    assert isinstance(err, TypeError) and "True or False" in str(err)
    _refused("NaNCheck", "counts", 0.5)
    assert P.StatCollector(grads=1).grads is True and P.StatCollector(grads=0).grads is False
    err = _refused("ShapeAssert", "dynamic_dims", 0)
    assert isinstance(err, TypeError) and "(0,)" in str(err)
    assert P.ShapeAssert(dynamic_dims=[0, 1]).dynamic_dims == (0, 1)
    assert P.ShapeAssert(dynamic_dims=()).dynamic_dims == ()


@pytest.mark.parametrize("name,option", FLAGS)
def test_flags_are_bools_or_0_and_1(name, option):
    assert len(FLAGS) >= 18  # StatCollector(exact=) was a no-op and is gone (issue 32 item 7)
    for value, want in ((True, True), (False, False), (1, True), (0, False)):
        p = _build(name, **{option: value})
        stored = getattr(p, option, want)
        assert stored is want, (name, option, value, stored)


@settings(max_examples=25, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate, Phase.shrink))
@given(case=st.sampled_from(FLAGS),
       value=st.one_of(st.text(max_size=4), st.integers().filter(lambda i: i not in (0, 1)),
                       st.floats().filter(lambda f: f not in (0.0, 1.0)), st.none(), st.lists(st.booleans(), max_size=2)))
def test_flags_refuse_everything_else(case, value):
    name, option = case
    assert isinstance(_refused(name, option, value), fxdebug.ArgumentTypeError)


@pytest.mark.parametrize("name,option,kind", NUMBERS)
def test_numbers_refuse_bools_strings_and_nan(name, option, kind):
    bad = [True, "3", [1]] + ([] if kind.endswith("?") else [None]) + ([2.5] if kind.startswith("int") else [math.nan])
    for value in bad:
        _refused(name, option, value)


@pytest.mark.parametrize("name,option,value", RANGES)
def test_values_outside_the_range_are_usage_errors_saying_what_is_accepted(name, option, value):
    err = _refused(name, option, value)
    assert not isinstance(err, TypeError)  # the right kind of value: a plain UsageError (a ValueError)
    assert " is " in str(err) and "got" in str(err)


@pytest.mark.parametrize("name,option,default", CHOICES)
def test_choices_name_their_choices(name, option, default):
    err = _refused(name, option, "nope")
    assert repr(default) in str(err) or default in str(err)
    assert isinstance(_refused(name, option, 3), fxdebug.ArgumentTypeError)


@pytest.mark.parametrize("name,option", [(n, p.name) for n, _, p in ALL if _kind(n, p) == "ints"])
def test_iterables_are_iterables(name, option):
    for value in (0, "0", [0.5], [True], None):
        _refused(name, option, value)
    assert getattr(_build(name, **{option: range(2)}), option) == (0, 1)


@pytest.mark.parametrize("name,option", [(n, p.name) for n, _, p in ALL if _kind(n, p) == "callable"])
def test_callables_are_callables(name, option):
    _refused(name, option, 3)


@pytest.mark.parametrize("key", sorted(SPECIAL))
def test_special_options(key):
    name, option = key
    good, bad = SPECIAL[key]
    for value in good:
        _build(name, **{option: value})
    for value in bad:
        _refused(name, option, value)


@pytest.mark.parametrize("name", [n for n in P.__all__ if "where" in inspect.signature(getattr(P, n).__init__).parameters])
def test_where_is_a_selection(name):
    for value in (3, ["fc", 3], b"fc", 0.5):
        err = _refused(name, "where", value)
        assert "glob" in str(err) and "predicate" in str(err)
    for value in (None, "fc", ["fc", "relu"], ("fc",), fxdebug.outputs_of("fc"), lambda n: True):
        if value is None and name in ("Breakpoint", "Freeze", "GradientScale"):
            continue  # these need a selection (their own UsageError)
        _build(name, where=value)
    assert _build(name, where=iter(["fc"])).where == ("fc",)


def test_a_users_pass_gets_the_same_rule():
    class Mine(fxdebug.Pass):
        def __init__(self, verbose=False, *, where=None):
            super().__init__(where=where)
            self.verbose = Options(self).flag("verbose", verbose)

    assert Mine(verbose=1).verbose is True
    with pytest.raises(fxdebug.ArgumentTypeError, match=r"Mine\(verbose='off'\): verbose is a flag"):
        Mine(verbose="off")

    @fxdebug.graph_pass(name="mine")
    def mine(gm, ctx):
        return None

    with pytest.raises(fxdebug.ArgumentTypeError, match=r"mine\(where=3\)"):
        mine(where=3)


def test_the_rule_as_docs_observe_md_states_it_runs():
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parents[1] / "docs" / "observe.md"
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S) if "backward=\"no\"" in b)
    exec(compile(block, str(doc), "exec"), {"fxdebug": fxdebug, "NaNCheck": P.NaNCheck, "StatCollector": P.StatCollector})
