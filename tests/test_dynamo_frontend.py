"""The Dynamo frontend itself: graphs, names, state, many modules of one class, a real HF model."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.errors import UsageError
from fxdebug.passes import NaNCheck, StatCollector


class MLP(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _dbg(model, x, **kw):
    return fxdebug.instrument(model, [NaNCheck(mode="record"), StatCollector()], example_inputs=(x,),
                              frontend="dynamo", **kw)


def test_nodes_are_named_by_module_path_and_op():
    dbg = _dbg(MLP(), torch.randn(2, 4))
    dbg(torch.randn(2, 4))
    names = [r["node"] for r in dbg.report().rows]
    assert names == ["x", "fc1", "relu", "fc2"]
    (part,) = dbg.parts().values()
    assert isinstance(part, torch.fx.GraphModule)
    # the model's parameters are read from the model (get_attr), not copied and not graph inputs
    targets = {str(n.target) for n in part.graph.nodes if n.op == "get_attr"}
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} <= targets


def test_shares_the_model_and_its_state_dict_keys():
    model = MLP()
    dbg = _dbg(model, torch.randn(2, 4))
    assert list(dbg.state_dict()) == list(model.state_dict())
    assert dbg.fc1 is model.fc1
    model.fc1 = nn.Linear(4, 8)
    assert dbg.fc1 is model.fc1  # no copy of _modules
    x = torch.randn(2, 4)
    assert torch.equal(dbg(x), model(x))


def test_instrument_does_not_run_the_model_state_forward():
    model = MLP()
    dbg = _dbg(model, torch.randn(2, 4))
    assert dbg.report().calls == 0  # the capturing call is not counted
    assert len(dbg.parts()) == 1  # but the graph is known (where= was checked against it)


def test_where_that_matches_nothing_is_refused():
    # the module paths named are the model's (they said "0/0/fc1": the capture's frame/recompile key in front)
    with pytest.raises(UsageError, match=r"Module paths in this model: fc1, fc2;"):
        fxdebug.instrument(MLP(), [StatCollector(where="nope*")], example_inputs=(torch.randn(2, 4),),
                           frontend="dynamo")


def test_many_modules_of_one_class_stay_instrumented():
    # one shared backend: Dynamo's per-class cache is not exhausted after eight modules
    x = torch.randn(2, 4)
    dbgs = [_dbg(MLP(), x) for _ in range(12)]
    for dbg in dbgs:
        dbg(x)
    assert all(dbg.report().row("fc1")["calls"] == 1 for dbg in dbgs)
    # each module's graph counts only its own calls
    dbgs[0](x)
    assert dbgs[0].report().row("fc1")["calls"] == 2 and dbgs[1].report().row("fc1")["calls"] == 1


def test_training_through_the_live_module_trains_the_model():
    model = MLP()
    ref = copy.deepcopy(model)
    dbg = _dbg(model, torch.randn(2, 4))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(2, 4)
        for m, o in ((dbg, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_reset_and_to_module():
    model, x = MLP(), torch.randn(2, 4)
    dbg = _dbg(model, x)
    dbg(x)
    dbg.reset()
    assert dbg.report().calls == 0
    # to_module(): a plain snapshot module of the model as it is now (it refused on a live capture)
    model.fc2 = nn.Linear(8, 2)
    plain = dbg.to_module()
    assert isinstance(plain, torch.fx.GraphModule) and not isinstance(plain, fxdebug.Instrumented)
    assert torch.equal(plain(x), model(x))
    assert not any("fxdebug" in str(n.target) for n in plain.graph.nodes)

    class Item(nn.Module):  # symbolic tracing cannot; without example inputs export cannot run either
        def forward(self, x):
            x = x.clone()
            x[:, 0] = 0.0
            return x

    bare = fxdebug.instrument(Item(), [NaNCheck()], frontend="dynamo")
    with pytest.raises(UsageError, match="export needs the example inputs"):
        bare.to_module()


def test_deepcopy_is_a_live_module_over_a_copy():
    model = MLP()
    dbg = _dbg(model, torch.randn(2, 4))
    other = copy.deepcopy(dbg)
    assert other.fc1 is not model.fc1
    x = torch.randn(2, 4)
    assert torch.equal(other(x), model(x))


def test_tiny_gpt2_with_labels_one_report():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 50, (2, 6))
    dbg = fxdebug.instrument(model, [NaNCheck(mode="record"), StatCollector()], example_inputs={"input_ids": ids},
                             frontend="dynamo")
    out = dbg(input_ids=ids)
    assert torch.equal(out.logits, model(input_ids=ids).logits)
    loss = dbg(input_ids=ids, labels=ids).loss  # a Trainer step's signature: a graph break at the loss
    assert torch.equal(loss, model(input_ids=ids, labels=ids).loss)
    report = dbg.report()
    assert report.calls == 2 and min(r["calls"] for r in report.rows) >= 1
    rows = {r["node"]: r for r in report.rows}
    assert rows["transformer_wte"]["module"] == "transformer.wte" and rows["transformer_wte"]["calls"] == 2
    assert any(r["module"].startswith("transformer.h.0.attn") for r in report.rows)
    assert report.first_nonfinite is None


def test_render_draws_the_captured_graph_and_attributes_pass_through(tmp_path):
    model = MLP()
    model.note = "kept"
    dbg = _dbg(model, torch.randn(2, 4))
    dbg(torch.randn(2, 4))
    out = dbg.render(str(tmp_path / "live.svg"))
    assert (tmp_path / "live.svg").exists() and out.endswith(".svg")
    assert dbg.note == "kept"  # the model's own attributes, through the live module


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_calls_under_a_user_dispatch_mode_run_the_graph_under_the_mode():
    # torch.compile skips a frame while a non-infra dispatch mode is on the stack: rows showed 0 calls
    model, x = MLP(), torch.randn(2, 4)
    dbg = _dbg(model, x)
    with _CountOps() as mode:
        for _ in range(3):
            y = dbg(x)
    assert torch.allclose(y, model(x))
    assert {r["node"]: r["calls"] for r in dbg.report().rows} == {"x": 3, "fc1": 3, "relu": 3, "fc2": 3}
    assert torch.ops.aten.addmm.default in mode.ops  # the user's mode still saw the graph's ops


def test_an_lstm_is_captured():
    model = nn.LSTM(4, 3, batch_first=True)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(torch.randn(2, 5, 4),), frontend="dynamo")
    x = torch.randn(2, 5, 4)
    assert torch.allclose(dbg(x)[0], model(x)[0])
    rows = dbg.report().rows
    assert rows and all(r["calls"] == 1 for r in rows)


class _Moded(MLP):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h) * (2.0 if self.training else 1.0)


def test_rows_merged_across_captures_follow_the_column_merge_rules():
    # model.eval(): the training guard fails, Dynamo captures the same forward again; relu's rows merge
    torch.manual_seed(0)
    model, x, x2 = _Moded(), torch.randn(16, 4), torch.randn(16, 4)
    dbg = _dbg(model, x)
    dbg(x)
    model.eval()
    dbg(x2)
    assert len(dbg.parts()) == 2
    (relu,) = [r for r in dbg.report().rows if r["node"] == "relu"]
    assert relu["calls"] == 2
    h = torch.relu(model.fc1(torch.cat([x, x2]))).detach()
    assert relu["dead_frac"] is not None  # was None: the merge ignored the column's declared rule
    assert relu["dead_frac"] == pytest.approx(float((h.amax(0) <= 0).float().mean()))
    assert relu["max"] == pytest.approx(float(h.max()), rel=1e-5)


class _Rest(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, *rest):
        return self.fc(x) + sum(rest)


def _tensor_inputs(part):  # not Dynamo's dynamic-size placeholders (s0, ...)
    return [n.name for n in part.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)]


def test_input_placeholders_carry_the_forward_parameter_names():
    seq = nn.Sequential(nn.Linear(4, 2))  # torch enters its forward through a wrapper: L['args'][0]
    dbg = _dbg(seq, torch.randn(2, 4))
    (part,) = dbg.parts().values()
    assert _tensor_inputs(part) == ["input_1"]  # as torch.fx names it
    dbg = fxdebug.instrument(_Rest(), [StatCollector()], frontend="dynamo")
    dbg(torch.randn(2, 4), torch.randn(2, 4))
    (part,) = dbg.parts().values()
    assert _tensor_inputs(part) == ["x", "rest_0"]  # was l_rest_0_


def test_model_moved_to_meta_after_instrument_gives_the_device_check_error():
    from fxdebug.passes import DeviceCheck

    model, x = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [DeviceCheck(), StatCollector()], example_inputs=(x,), frontend="dynamo")
    dbg(x)
    model.to("meta")
    assert dbg(x.to("meta")).device.type == "meta"
    with pytest.raises(fxdebug.DeviceMismatchError, match="would mix devices") as e:  # was Dynamo's own error
        dbg(x)
    assert e.value.node == "_0"
    assert "input_1" in str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__  # not buried under Dynamo's fake-tensor error


def test_param_grads_counts_the_first_backward_after_instrument():
    # the quiet capture call at instrument ran the probe for call 0; after reset() the user's call 0 was skipped
    from fxdebug.passes import ParamGrads

    model, x = MLP(), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [ParamGrads()], example_inputs=(x,), frontend="dynamo")
    dbg(x).sum().backward()
    rows = [r for r in dbg.report().rows if r.get("param_grad_calls")]
    assert {r["param_module"] for r in rows} == {"fc1", "fc2"}
    assert all(r["param_grad_calls"] == 1 for r in rows)


@pytest.mark.parametrize("name", ["lstm", "shared_module"])
def test_param_grads_cover_every_parameter_of_lstm_and_shared_modules(name):
    # torch.lstm in a Dynamo graph takes the weights as get_attr inputs and returns a tuple (no row of its
    # own): the statistics sit on its first getitem, as for the symbolic LSTM module
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from zoo import ZOO

    from fxdebug.passes import ParamGrads

    model, (x,) = ZOO[name]()
    dbg = fxdebug.instrument(model, [ParamGrads()], example_inputs=(x,), frontend="dynamo")
    model.zero_grad(set_to_none=True)
    dbg(x).sum().backward()
    rows = [r for r in dbg.report().rows if r.get("param_grad_calls")]
    assert sum(r["param_count"] for r in rows) == sum(p.numel() for p in model.parameters())
    for r in rows:
        grads = torch.cat([p.grad.reshape(-1) for p in model.get_submodule(r["param_module"]).parameters()]).double()
        assert r["param_grad_max_abs"] == pytest.approx(float(grads.abs().max()), rel=1e-6)
        assert r["param_grad_norm"] == pytest.approx(float(grads.norm()), rel=1e-5)


def test_param_grads_merge_over_a_no_grad_recompile():
    # a call under no_grad is another capture (grad-mode guard); its rows have no backward: the merged row
    # keeps the counts of the captures that had one (was None with an "unknown" note)
    from fxdebug.passes import ParamGrads

    model, x = MLP(), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [ParamGrads()], example_inputs=(x,), frontend="dynamo")
    dbg(x).sum().backward()
    (2 * dbg(x).sum()).backward()
    with torch.no_grad():
        dbg(x)
    report = dbg.report()
    assert len(dbg.parts()) == 2
    row = report.row("fc2")
    assert row["param_grad_calls"] == 2 and row["param_grad_max_abs"] is not None
    assert not any("could not tell" in n for n in report.notes)


def test_saved_and_loaded_keeps_the_report_and_adds_to_it():
    import io

    model, x = MLP(), torch.randn(2, 4)
    dbg = _dbg(model, x)
    dbg(x)
    with torch.no_grad():
        model.fc1.bias[0] = float("nan")
    dbg(x)  # a NaN from call 1 on: one capture, two calls
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    before = dbg.report()
    after = loaded.report()
    assert repr(after.rows) == repr(before.rows) and after.calls == 2  # repr: NaN != NaN
    assert after.first_nonfinite == before.first_nonfinite == "fc1"
    assert any("before the module was saved" in n for n in after.notes)
    assert [r.pass_name for r in loaded.pass_results] == [r.pass_name for r in dbg.pass_results] == [
        "nan-check", "stat-collector"]
    assert [r.pass_name for r in fxdebug.trace(dbg).pass_results] == ["nan-check", "stat-collector"]
    loaded(x)  # the loaded module captures again; its rows add to the saved ones
    again = loaded.report()
    assert again.calls == 3 and again.row("fc1")["calls"] == 3 and dbg.report().calls == 2
    assert [r["node"] for r in again.rows] == [r["node"] for r in before.rows]  # the same names: merged, not new rows
    loaded.reset()
    assert loaded.report().calls == 0 and all(r["calls"] == 0 for r in loaded.report().rows)


class _Sqrt(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return torch.sqrt(torch.relu(self.fc(x))).sum()


def test_backward_nonfinite_names_the_producing_user():
    # the merged report kept first_nonfinite_grad but dropped the part's nonfinite_grad_from
    torch.manual_seed(0)
    model, x = _Sqrt(), torch.randn(4, 3)
    dbg = fxdebug.instrument(model, [NaNCheck(backward=True)], example_inputs=(x,), frontend="dynamo")
    dbg(x).backward()
    report = dbg.report()
    assert report.first_nonfinite_grad == "relu" and report.nonfinite_grad_from == ["sqrt"]
    assert "from the backward of sqrt" in str(report)


def test_nonfinite_weights_are_blamed_in_raise_and_record_mode():
    # Dynamo's torch.linear reads fc.weight as a get_attr input: the message named it an input "from a node
    # NaNCheck does not watch" instead of a non-finite parameter
    import math

    model, x = MLP(), torch.randn(2, 4)
    raising = fxdebug.instrument(model, [NaNCheck(mode="raise")], example_inputs=(x,), frontend="dynamo")
    recording = _dbg(model, x)
    with torch.no_grad():
        model.fc1.weight[0, 0] = math.inf
    with pytest.raises(fxdebug.NonFiniteError, match=r"node 'fc1'.*parameter\(s\) fc1.weight are not finite"):
        raising(x)
    recording(x)
    report = recording.report()
    assert report.first_nonfinite == "fc1" and report.nonfinite_params == ["fc1.weight"]


class _Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("broken forward")


def test_a_forward_that_cannot_run_is_a_trace_error_naming_the_line():
    x = torch.randn(2, 4)
    with pytest.raises(fxdebug.TraceError, match=r"_Boom's own forward raised RuntimeError on the example inputs: "
                                                 r"broken forward \(at test_dynamo_frontend.py:\d+") as e:
        fxdebug.instrument(_Boom(), [NaNCheck()], example_inputs=(x,), frontend="dynamo")
    assert isinstance(e.value.__cause__, RuntimeError)
    # without example inputs the first call is the capture: the same typed error there
    dbg = fxdebug.instrument(_Boom(), [NaNCheck()], frontend="dynamo")
    with pytest.raises(fxdebug.TraceError, match=r"raised RuntimeError at its first call.*broken forward"):
        dbg(x)


def test_after_a_call_has_run_the_model_exceptions_are_its_own():
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] > 3:
                raise ValueError("batch too large")
            return self.fc(x)

    dbg = fxdebug.instrument(Picky(), [NaNCheck()], frontend="dynamo")
    dbg(torch.randn(2, 4))
    with pytest.raises(ValueError, match="batch too large") as e:
        dbg(torch.randn(5, 4))
    assert not isinstance(e.value, fxdebug.FxDebugError)


def test_none_arguments_of_a_capturing_call_are_named_and_a_value_captures_again():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x, *, scale: float = 1.0, mask=None):
            y = self.fc(x) * scale
            return y if mask is None else y.masked_fill(mask, 0.0)

    model, x = Masked(), torch.randn(3, 6)
    dbg = _dbg(model, x)
    assert any("captured with mask None" in n for n in dbg.report().notes)
    mask = x > 0
    assert torch.equal(dbg(x, mask=mask), model(x, mask=mask)) and torch.equal(dbg(x), model(x))
    assert len(dbg.parts()) == 2 and dbg.report().row("fc")["calls"] == 2


def test_a_training_callback_routing_to_a_live_module_runs_the_root_hooks_once():
    # the session routes model.forward to the live module, which calls the model (and its hooks) again
    from fxdebug.integrations._session import Session

    model, seen = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), []
    model.register_forward_pre_hook(lambda m, i: seen.append("pre"))
    model.register_forward_hook(lambda m, i, o: seen.append("post"))
    session = Session(None, top_k=None, frontend="dynamo")
    session.attach(model)
    model(torch.randn(2, 4))
    model(torch.randn(2, 4))
    session.detach()
    assert session.dbg.trace_info.frontend == "dynamo"
    assert seen == ["pre", "post", "pre", "post"] and session.calls == 2
    assert len(session.dbg.parts()) == 1  # one capture: the routed calls all see the hooks emptied


def test_a_forward_wrapped_by_an_args_decorator_keeps_module_paths_and_input_names():
    # Hugging Face wraps Llama's forward in `def wrapper(*args, **kwargs)`: Dynamo's frame is the wrapper, the
    # module is L['args'][0]; rows said "0.fc1" and the weights were observed as anonymous input placeholders
    import functools

    def wrapped(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    class Wrapped(MLP):
        @wrapped
        def forward(self, x, scale=None):
            return self.fc2(torch.relu(self.fc1(x)))

    model, x = Wrapped(), torch.randn(2, 4)
    dbg = _dbg(model, x)
    dbg(x)
    rows = dbg.report().rows
    assert [(r["node"], r["module"]) for r in rows] == [("x", ""), ("fc1", "fc1"), ("relu", ""), ("fc2", "fc2")]
    (part,) = dbg.parts().values()
    assert {"fc1.weight", "fc2.bias"} <= {str(n.target) for n in part.graph.nodes if n.op == "get_attr"}


def _conv_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()


def test_torch_compile_over_a_live_module_leaves_the_capture_to_it():
    # the outer Dynamo traced into the live module's own Python and compiled ~40 small frames of fxdebug
    import torch._dynamo

    model, x = _conv_model(), torch.randn(2, 3, 8, 8)
    dbg = _dbg(model, x)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(dbg, backend="eager")
    with torch.no_grad():
        for _ in range(5):
            out = compiled(x)
    assert torch.equal(out, model(x))
    assert torch._dynamo.utils.counters["frames"]["total"] <= 3  # the inner capture (a no_grad recompile) only
    report = dbg.report()
    assert report.calls == 5 and report.row("_2")["calls"] == 5


def test_a_capture_that_did_not_run_since_reset_does_not_blur_merged_rows():
    # instrument's quiet call captured with grad on; the user's no_grad calls run a recompile. The first graph's
    # rows (0 calls since reset) merged with the second's made dead_frac "unknown" (None) with a note
    model, x = _conv_model(), torch.randn(2, 3, 8, 8)
    dbg = _dbg(model, x)
    with torch.no_grad():
        dbg(x)
    report = dbg.report()
    assert len(dbg.parts()) == 2
    assert report.row("_2")["dead_frac"] is not None
    assert not any("could not tell" in n for n in report.notes)


class _WrongSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x  # should be 2 * g * x


def test_gradcheck_on_a_live_module_finds_the_wrong_backward_with_its_example_inputs():
    # Dynamo makes a custom autograd Function a higher-order op (no node of its own), and the live module kept no
    # example inputs: gradcheck(dbg) raised MissingInputsError, and with inputs found no node to check
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(4, 3), nn.Linear(3, 2)

        def forward(self, x):
            return self.head(_WrongSquare.apply(self.fc(x)))

    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(Net(), [StatCollector()], example_inputs=(x,), frontend="dynamo")
    result = fxdebug.gradcheck(dbg)
    assert [r.op for r in result.failures] == ["_WrongSquare.apply"]


def test_instrument_capture_fires_no_pass_action_on_the_example_inputs():
    # the capture call ran the instrumented graph: a Breakpoint fired and raise mode raised at instrument time
    from fxdebug.passes import Breakpoint

    class Sqrt(nn.Module):
        def forward(self, x):
            return torch.sqrt(x) + 1

    hits = []
    x = -torch.ones(2, 3)  # NaN on the example inputs
    bp = Breakpoint(None, when=fxdebug.when.nonfinite, action=hits.append)
    dbg = fxdebug.instrument(Sqrt(), [bp], example_inputs=(x,), frontend="dynamo")
    assert hits == [] and len(dbg.parts()) == 1
    dbg(x)
    assert [h.node for h in hits][:1] == ["sqrt"] and hits[0].call == 0
    raising = fxdebug.instrument(Sqrt(), [NaNCheck(mode="raise")], example_inputs=(x,), frontend="dynamo")
    with pytest.raises(fxdebug.NonFiniteError, match="node 'sqrt'"):
        raising(x)


def test_shape_assert_holds_the_first_capture_expectation_across_recompiles():
    # each recompile (another shape, dtype) was instrumented on its own first call: ShapeAssert learnt the new
    # shape as "expected" and never raised
    from fxdebug.passes import ShapeAssert

    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            return self.conv1(x)

    dbg = fxdebug.instrument(Conv(), [ShapeAssert()], example_inputs=(torch.randn(2, 3, 8, 8),), frontend="dynamo")
    assert dbg(torch.randn(5, 3, 8, 8)).shape == (5, 4, 8, 8)  # the batch may vary
    with pytest.raises(fxdebug.ShapeMismatchError) as info:
        dbg(torch.randn(5, 3, 6, 6))
    assert re.match(r"node 'x' \(module <root>, placeholder\) produced \(N, 3, 6, 6\); expected \(N, 3, 8, 8\)",
                    str(info.value)) or re.match(
        r"node 'conv1' \(module conv1, torch\.conv2d\) produced \(N, 4, 6, 6\); expected \(N, 4, 8, 8\)\. "
        r"Inputs: \(N, 3, 6, 6\)\.", str(info.value)), str(info.value)  # weights are not listed as inputs
    linear = nn.Linear(4, 2)
    dbg = fxdebug.instrument(linear, [ShapeAssert()], example_inputs=(torch.randn(3, 4),), frontend="dynamo")
    linear.double()
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"produced float64 \(N, 4\); expected float32 \(N, 4\)"):
        dbg(torch.randn(3, 4, dtype=torch.float64))


def test_channel_maxima_for_merging_ranks_come_from_every_capture():
    # report(all_ranks=True) merges dead_frac by per-channel maxima; they were read from one capture's observers
    # per node (the instrument-time graph, 0 calls after a no_grad recompile): no maxima, dead_frac None
    from fxdebug.report.distributed import channel_maxima

    model, x = MLP(), torch.randn(3, 4)
    dbg = _dbg(model, x)
    with torch.no_grad():
        dbg(x)
        expected = torch.relu(model.fc1(x)).amax(0)
    assert len(dbg.parts()) == 2
    assert channel_maxima(dbg)["relu"] == pytest.approx(expected.tolist())


def test_constructs_dynamo_does_not_guard_are_refused_and_a_tensor_hook_is_kept():
    # a global module hook after instrument ran silently without it; a child named 'fxdebug' failed with the
    # model's own AttributeError; a lazy module was materialized by instrument(); a tensor hook in forward failed
    # while learning shapes (no_grad)
    x = torch.randn(2, 4)
    model = MLP()
    dbg = _dbg(model, x)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        with pytest.raises(fxdebug.TraceError, match="global module hook"):
            dbg(x)
    finally:
        handle.remove()
    assert torch.equal(dbg(x), model(x))  # removed: runs again

    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.fxdebug = nn.Linear(4, 4)

        def forward(self, x):
            return self.fxdebug(x)

    with pytest.raises(fxdebug.TraceError, match="named 'fxdebug'"):
        _dbg(Named(), x)
    lazy = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(fxdebug.TraceError, match="lazy module"):
        _dbg(lazy, x)
    assert isinstance(lazy[0], nn.LazyLinear)

    class Reverse(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            y.register_hook(lambda g: -g)
            return y.sum()

    model = Reverse()
    dbg = _dbg(model, x)
    dbg(x).backward()
    grad = model.fc.weight.grad.clone()
    model.zero_grad()
    model(x).backward()
    assert torch.equal(grad, model.fc.weight.grad)


def test_hooks_registered_on_the_live_module_itself_run():
    # dbg's own hooks (fully_shard(dbg) gathers parameters in one) never ran: the live call bypassed nn.Module's
    model, x = MLP(), torch.randn(2, 4)
    dbg = _dbg(model, x)
    dbg.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    seen = []
    dbg.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    assert torch.equal(dbg(x), model(x * 0)) and seen == [(2, 2)]
    assert dbg.report().calls == 1



def test_other_compiled_modules_filling_dynamos_shared_entry_do_not_stop_capture():
    # torch.compile(module) enters through one wrapper code object shared by every compiled module of the process;
    # once anyone's torch.compile calls hit its recompile limit, every new live module ran eagerly: no graph, no rows
    import warnings

    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(70):
            torch.compile(nn.Identity(), backend="eager")(x)
    dbg = _dbg(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), x)
    dbg(x)
    assert len(dbg.parts()) == 1 and dbg.report().row("_0")["calls"] == 1


def test_an_op_failing_on_the_first_call_run_eagerly_names_its_node():
    # a frame Dynamo runs eagerly (disabled, a graph break, a skipped frame) raises the op's own RuntimeError: before
    # a call had run it became the generic TraceError instead of the node-naming ShapeMismatchError
    class Eager(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        @torch._dynamo.disable
        def forward(self, x):
            return self.fc(x)

    dbg = fxdebug.instrument(Eager(), [NaNCheck()], frontend="dynamo")
    with pytest.raises(fxdebug.ShapeMismatchError, match="node 'fc'"):
        dbg(torch.randn(2, 4))


def test_auto_takes_the_guarded_snapshot_above_the_live_module_limit():
    # Dynamo traces ~5-10 ms a module: a 1,000-module chain would take seconds to minutes to capture live
    from fxdebug.api import LIVE_MODULE_LIMIT

    big = nn.Sequential(*[nn.Linear(2, 2) for _ in range(LIVE_MODULE_LIMIT)])  # + the Sequential itself
    x = torch.randn(1, 2)
    dbg = fxdebug.instrument(big, [NaNCheck()], example_inputs=(x,))
    assert dbg.trace_info.frontend == "symbolic"
    assert any("more than 1000 modules" in n and "frontend='dynamo'" in n for n in dbg.trace_info.notes)
    assert torch.equal(dbg(x), big(x))
    small = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    assert fxdebug.instrument(small, [NaNCheck()], example_inputs=(x,)).trace_info.frontend == "dynamo"


def test_the_settings_of_a_live_call_are_put_back_exactly():
    import warnings

    import torch._dynamo.config as config

    from fxdebug.capture.dynamo import dynamo_config, quiet_warnings

    names = ("skip_nnmodule_hook_guards", "allow_rnn", "recompile_limit", "automatic_dynamic_shapes")
    before = {k: getattr(config, k) for k in names}
    unset = {k: config._is_default(k) for k in names} if hasattr(config, "_is_default") else None
    with dynamo_config(first=True):
        assert (config.skip_nnmodule_hook_guards, config.allow_rnn, config.recompile_limit,
                config.automatic_dynamic_shapes) == (False, True, 256, False)
        with dynamo_config():  # nested (a live module inside another): its settings, then the outer's again
            assert config.recompile_limit == 256 and config.automatic_dynamic_shapes is False  # not one it sets
            config.recompile_limit = 3  # changed inside: put back by the inner's exit
        assert config.recompile_limit == 256 and config.automatic_dynamic_shapes is False
    assert {k: getattr(config, k) for k in names} == before
    if unset is not None:  # left as "not overridden", not overridden with the default's value
        assert {k: config._is_default(k) for k in names} == unset
    filters = list(warnings.filters)
    with quiet_warnings(r"Dynamo does not know how to trace")():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            warnings.warn("a user's warning")
        assert [str(w.message) for w in seen] == ["a user's warning"]
    assert warnings.filters == filters
