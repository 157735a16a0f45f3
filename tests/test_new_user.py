"""A new user's day (issue 14): each test is one thing a first-time user tripped over."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdebug
from fxdebug import FxDebugError, ShapeMismatchError
from fxdebug.passes import StatCollector


class PoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 13 * 13, 5)

    def forward(self, x):
        y = F.max_pool2d(self.conv(x), 2)
        return self.fc(torch.flatten(y, 1))


def test_torch_save_of_a_model_calling_f_max_pool2d():
    x = torch.randn(1, 1, 28, 28)
    # pickling a symbolic graph that calls F.max_pool2d (a boolean-dispatch function) is the subject
    dbg = fxdebug.instrument(PoolNet(), [StatCollector()], example_inputs=(x,), frontend="symbolic")
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), dbg(x))
    assert any(n.target is F.max_pool2d for n in loaded.graph.nodes)


class InPlaceInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


@pytest.mark.parametrize("frontend", ["symbolic", "export", "subtrees"])
def test_shape_run_leaves_the_example_inputs_alone(frontend):
    x = torch.ones(2, 4)
    fxdebug.instrument(InPlaceInput(), [StatCollector()], example_inputs=(x,), frontend=frontend)
    assert torch.equal(x, torch.ones(2, 4))


def test_conv_fed_an_unbatched_input_names_the_missing_dimension():
    with pytest.raises(ShapeMismatchError) as info:
        fxdebug.instrument(nn.Conv2d(1, 8, 3), [], example_inputs=(torch.randn(4, 28, 28),))
    msg = str(info.value)
    assert "in_channels=28" not in msg and "set in_channels" not in msg
    assert "no batch dimension" in msg and "x.unsqueeze(1)" in msg and "(4, 1, 28, 28)" in msg


def test_conv_module_fed_a_batched_input_with_wrong_channels_still_says_in_channels():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)

        def forward(self, x):
            return self.conv(x)

    with pytest.raises(ShapeMismatchError, match=r"set in_channels=1"):
        fxdebug.instrument(Net(), [], example_inputs=(torch.randn(2, 1, 28, 28),))


class FlattenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 26 * 26, 5)

    def forward(self, x):
        y = self.conv(x)
        z = torch.flatten(y, 1)
        return self.fc(z)


def test_run_time_provenance_shows_the_failing_calls_shapes_not_the_example_runs():
    dbg = fxdebug.instrument(FlattenNet(), [], example_inputs=(torch.randn(1, 1, 28, 28),))
    with pytest.raises(ShapeMismatchError) as info:
        dbg(torch.randn(1, 1, 32, 32))
    msg = str(info.value)
    assert "(1, 1800)" in msg and "'flatten'" in msg
    assert "(1, 2, 26, 26)" not in msg  # the example run's shape, not this call's


def test_ops_inside_a_root_sequential_get_no_misleading_source_line():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(ShapeMismatchError) as info:
        fxdebug.instrument(seq, [], example_inputs=(torch.randn(2, 4),))
    assert "test_new_user.py" not in str(info.value)  # the instrument() call is not where the op lives
    dbg = fxdebug.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert all(fxdebug.graph.meta.source_line(n) is None for n in dbg.graph.nodes)


def test_source_line_of_an_op_in_the_users_forward_is_kept():
    dbg = fxdebug.trace(FlattenNet())
    node = next(n for n in dbg.graph.nodes if n.target is torch.flatten)
    assert "test_new_user.py" in fxdebug.graph.meta.source_line(node) and "torch.flatten(y, 1)" in fxdebug.graph.meta.source_line(node)


def test_errors_are_fxdebug_errors():
    assert issubclass(ShapeMismatchError, FxDebugError)


# -- item 7: mistakes that used to be accepted silently --------------------------------------
def test_extra_example_inputs_are_refused():
    with pytest.raises(fxdebug.UsageError, match=r"2 positional example inputs were given but forward takes 1"):
        fxdebug.instrument(FlattenNet(), [], example_inputs=(torch.randn(1, 1, 28, 28), torch.randn(3)))


def test_unknown_keyword_example_input_is_refused():
    with pytest.raises(fxdebug.UsageError, match=r"mask"):
        fxdebug.trace(FlattenNet(), {"x": torch.randn(1, 1, 28, 28), "mask": torch.ones(1)})


def test_where_matching_nothing_is_refused_naming_the_modules():
    with pytest.raises(fxdebug.UsageError, match=r"where='layer9\*' matches no node.*conv, fc"):
        fxdebug.instrument(FlattenNet(), [StatCollector(where="layer9*")], example_inputs=(torch.randn(1, 1, 28, 28),))
    dbg = fxdebug.instrument(FlattenNet(), [StatCollector(where="conv")], example_inputs=(torch.randn(1, 1, 28, 28),))
    assert [r["module"] for r in dbg.report().rows] == ["conv"]


@pytest.mark.parametrize("bad", ["yes", "no", None, 0.5, 2])
def test_stat_collector_flags_must_be_bools(bad):
    with pytest.raises(fxdebug.UsageError, match=r"StatCollector\(grads=.*grads is a flag: True or False"):
        StatCollector(grads=bad)


def test_stat_collector_flags_take_one_and_zero_as_bools():  # issue 35 B11: one rule, grads=1 is True
    assert StatCollector(grads=1).grads is True and StatCollector(grads=0).grads is False


def test_mistyped_example_input_says_did_you_mean():
    with pytest.raises(fxdebug.UsageError, match=r"unknown option example_input=\. Did you mean example_inputs=\?"):
        fxdebug.instrument(FlattenNet(), [], example_input=(torch.randn(1, 1, 28, 28),))


# -- item 8: paths -------------------------------------------------------------------------
def test_render_into_a_missing_directory_says_so(tmp_path):
    dbg = fxdebug.trace(FlattenNet())
    with pytest.raises(fxdebug.UsageError, match=r"directory .*no.*such.* does not exist"):
        dbg.render(str(tmp_path / "no" / "such" / "x.svg"))


# -- item 9 --------------------------------------------------------------------------------
def test_capture_grad_without_grads_true_says_why():
    from fxdebug.passes import Capture

    cap = Capture(["conv"])
    dbg = fxdebug.instrument(FlattenNet(), [cap], example_inputs=(torch.randn(1, 1, 28, 28),))
    dbg(torch.randn(1, 1, 28, 28)).sum().backward()
    assert cap["conv"] is not None
    with pytest.raises(fxdebug.UsageError, match=r"grads=True"):
        cap.grad("conv")
    with_grads = Capture(["conv"], grads=True)
    dbg = fxdebug.instrument(FlattenNet(), [with_grads], example_inputs=(torch.randn(1, 1, 28, 28),))
    dbg(torch.randn(1, 1, 28, 28)).sum().backward()
    assert with_grads.grad("conv").shape == (1, 2, 26, 26)


# -- item 10: the model keeps its face -----------------------------------------------------
class Generator(nn.Module):
    """A model with its own config, a property and a method that calls ``self`` in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.config = {"steps": 3}

    @property
    def width(self) -> int:
        return self.lin.in_features

    def forward(self, x):
        return torch.tanh(self.lin(x))

    def generate(self, x):
        for _ in range(self.config["steps"]):
            x = self(x)
        return x


def test_methods_and_attributes_pass_through_and_run_instrumented():
    model = Generator()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    assert dbg.config is model.config and dbg.width == 4
    assert torch.equal(dbg.generate(x), model.generate(x))
    assert dbg.report().calls == 3  # generate called the instrumented forward
    with pytest.raises(AttributeError, match="neither has the model"):
        dbg.no_such_thing


class ModeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y * 0 if self.training else y


@pytest.mark.parametrize("frontend", ["symbolic", "export", "subtrees"])
def test_eval_switches_the_root_and_what_it_computes(frontend):
    model = ModeBranch()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [], example_inputs=(x,), frontend=frontend)
    dbg.eval()
    assert dbg.training is False and all(not m.training for m in dbg.modules())
    assert torch.equal(dbg(x), model.eval()(x))


# -- item 11: a NaN made in eager code between captured parts -------------------------------
class EagerLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 2)
        with torch.no_grad():
            self.enc.weight.copy_(torch.eye(4))
            self.enc.bias.zero_()

    def forward(self, x):
        h = torch.log(self.enc(x))  # in the root's eager forward: NaN for negative inputs
        return self.dec(h)


def test_nan_made_in_eager_code_between_parts_is_not_blamed_on_a_part():
    from fxdebug.passes import NaNCheck

    model = EagerLog()
    x = torch.rand(8, 4) + 0.5
    dbg = fxdebug.instrument(model, [NaNCheck(mode="record")], example_inputs=(x,), frontend="subtrees")
    assert set(dbg.parts()) == {"enc", "dec"}
    dbg(-x)
    report = dbg.report()
    assert report.first_nonfinite is None  # not 'dec/input_1': the part only received it
    assert report.nonfinite_in_eager == "<root>"
    note = next(n for n in report.notes if n.startswith("NaN/Inf origin: in uninstrumented (eager) code"))
    assert "'dec'" in note and "EagerLog" in note
