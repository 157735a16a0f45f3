"""``fxdebug.collect``: a whole data set through an instrumented model, with a progress bar."""

from __future__ import annotations

import io
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fxdebug
from fxdebug.numerics.collect import make_progress, split_batch
from fxdebug.passes import NaNCheck, ParamGrads, StatCollector
from zoo import ZOO


def _loader(n=24, batch=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))
    return DataLoader(data, batch_size=batch)


def _ce(out, batch):
    return F.cross_entropy(out, batch[1])


def test_every_batch_forward_and_backward_matches_a_hand_loop():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    passes = lambda: [NaNCheck(), StatCollector(grads=True), ParamGrads()]  # noqa: E731
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,))
    report = fxdebug.collect(dbg, _loader(), loss_fn=_ce, progress=False)
    assert report.calls == 4 and report.failure is None
    assert report.row("fc")["param_grad_calls"] == 4 and report.row("fc")["grad_norm"] > 0

    hand = fxdebug.instrument(model, passes(), example_inputs=(x,))
    for inputs, targets in _loader():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(hand(inputs), targets).backward()
    model.zero_grad(set_to_none=True)
    expected = hand.report()
    inner = next(r["node"] for r in expected.rows if r["module"] == "layer1.1" and r["op"].endswith("relu"))
    for key in ("mean", "std", "max", "grad_norm", "param_grad_norm"):
        for node in ("stem_0", inner, "fc"):
            if key in expected.row(node):
                assert report.row(node)[key] == pytest.approx(expected.row(node)[key], rel=1e-6), (node, key)


def test_grads_are_put_back_and_no_backward_without_loss_fn():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector(grads=True)], example_inputs=(x,))
    marker = torch.full_like(model.fc.weight, 7.0)
    model.fc.weight.grad = marker
    fxdebug.collect(dbg, _loader(), loss_fn=_ce, progress=False)
    assert model.fc.weight.grad is marker and model.stem[0].weight.grad is None
    report = fxdebug.collect(dbg, _loader(), progress=False)  # forward only: no_grad, no gradient columns
    assert report.calls == 4 and report.row("fc").get("grad_norm") is None


def test_batches_limits_and_reset_starts_afresh():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    assert fxdebug.collect(dbg, _loader(), batches=2, progress=False).calls == 2
    assert fxdebug.collect(dbg, _loader(), batches=3, progress=False).calls == 3
    assert fxdebug.collect(dbg, _loader(), batches=1, progress=False, reset=False).calls == 4
    assert fxdebug.collect(dbg, iter(_loader()), progress=False).calls == 4  # no len(): a generator
    with pytest.raises(fxdebug.UsageError, match="positive"):
        fxdebug.collect(dbg, _loader(), batches=0)


def test_batch_forms_tensor_tuple_and_dict():
    model, (x,) = ZOO["kwargs_inputs"]()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    tensors = [torch.randn(3, 6) for _ in range(3)]
    assert fxdebug.collect(dbg, tensors, progress=False).calls == 3
    pairs = [(t, torch.zeros(3, 6)) for t in tensors]
    seen = []
    report = fxdebug.collect(dbg, pairs, loss_fn=lambda out, b: seen.append(b) or F.mse_loss(out, b[1]), progress=False)
    assert report.calls == 3 and seen[0] is pairs[0]
    dicts = [{"x": t, "scale": 2.0, "labels": torch.zeros(3, 6)} for t in tensors]
    report = fxdebug.collect(dbg, dicts, loss_fn=lambda out, b: F.mse_loss(out, b["labels"]), progress=False)
    assert report.calls == 3
    assert split_batch(dicts[0], dbg) == ((), {"x": tensors[0], "scale": 2.0})
    assert split_batch(((tensors[0],), "target"), dbg) == ((tensors[0],), {})
    with pytest.raises(fxdebug.UsageError, match="names an input"):
        split_batch({"labels": tensors[0]}, dbg)
    with pytest.raises(fxdebug.UsageError, match="cannot read a batch"):
        split_batch("text", dbg)


def test_a_batch_that_fails_a_check_stops_and_is_a_finding():
    model, (x,) = ZOO["dict_outputs"]()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    batches = [torch.randn(3, 6), torch.randn(3, 6), torch.randn(3, 5), torch.randn(3, 6)]
    report = fxdebug.collect(dbg, batches, progress=False)
    assert isinstance(report.failure, fxdebug.ShapeMismatchError)
    assert report.calls == 3  # the third call started (and failed); the fourth batch never ran
    assert report.failure.node == "body"
    (first, *_) = report.findings()
    assert first.kind == "check_failed" and first.node == "body" and "ShapeMismatchError" in str(first)
    assert report.notes[-1] == "collect: 2 batch(es), forward; stopped at batch 3"


class _Log(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.fc(x)).relu()


def test_progress_bar_shows_running_nan_and_dead_counts(capsys):
    torch.manual_seed(0)
    model = _Log()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(torch.randn(2, 4),))
    report = fxdebug.collect(dbg, [torch.randn(8, 4) for _ in range(5)])  # tqdm is installed in the test env
    err = capsys.readouterr().err
    assert "fxdebug.collect" in err and "5/5" in err
    assert f"NaN/Inf nodes {len(report.nonfinite_nodes)}" in err and len(report.nonfinite_nodes) >= 1
    assert report.first_nonfinite == "log"


def test_plain_progress_and_fallback_when_no_library(monkeypatch):
    stream = io.StringIO()
    bar = make_progress("plain", 3, stream)
    bar.update(1, None)
    bar.update(2, {"nan": 1, "dead": 2})
    bar.close(3, {"nan": 1, "dead": 2})
    lines = stream.getvalue().splitlines()
    assert lines == ["fxdebug.collect: 2/3 batches · NaN/Inf nodes 1 · dead 2",
                     "fxdebug.collect: 3/3 batches · NaN/Inf nodes 1 · dead 2"]
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    monkeypatch.setitem(sys.modules, "rich.progress", None)
    stream = io.StringIO()
    make_progress(True, 3, stream)
    assert "no progress library found (pip install tqdm, or rich)" in stream.getvalue()
    with pytest.raises(ImportError, match="pip install tqdm"):
        make_progress("tqdm", 3, stream)
    assert isinstance(make_progress(False, 3, stream), type(make_progress(None, 3, stream)))


def test_rich_progress(capsys):
    pytest.importorskip("rich")
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    fxdebug.collect(dbg, _loader(), progress="rich")
    err = capsys.readouterr().err
    assert "fxdebug.collect" in err and "4/4" in err and "dead 0" in err


def test_collect_refuses_a_plain_model_and_a_bad_loss():
    model, (x,) = ZOO["residual_cnn"]()
    with pytest.raises(fxdebug.UsageError, match="instrumented module"):
        fxdebug.collect(model, _loader())
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    with pytest.raises(fxdebug.UsageError, match="scalar"):
        fxdebug.collect(dbg, _loader(), loss_fn=lambda out, b: out, progress=False)


def test_the_failure_is_in_the_json():
    import json

    model, (x,) = ZOO["dict_outputs"]()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    report = fxdebug.collect(dbg, [torch.randn(3, 5)], progress=False)
    failure = json.loads(report.to_json())["failure"]
    assert failure["error"] == "ShapeMismatchError" and failure["node"] == "body"
    assert json.loads(fxdebug.collect(dbg, [x], progress=False).to_json())["failure"] is None


class _WithLabels(nn.Module):
    """A Hugging Face-style forward: the loss is computed inside when ``labels`` are given."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        if labels is None:
            return {"logits": logits}
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def test_dict_batch_keys_the_example_lacked_still_reach_the_model():
    """B8: a graph captured from {"x"} alone dropped the batch's "labels" silently."""
    torch.manual_seed(0)
    model, x = _WithLabels(), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs={"x": x}, frontend="export")
    batch = {"x": torch.randn(2, 4), "labels": torch.tensor([0, 2])}
    args, kwargs = split_batch(batch, dbg)
    assert args == () and set(kwargs) == {"x", "labels"}
    losses = []
    fxdebug.collect(dbg, [batch], loss_fn=lambda out, b: losses.append(out["loss"]) or out["loss"], progress=False)
    torch.testing.assert_close(losses[0], model(**batch)["loss"])
    assert split_batch({"x": x, "weights": x}, dbg)[1].keys() == {"x"}  # not an input: stays for loss_fn
