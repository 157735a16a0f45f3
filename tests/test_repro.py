"""fxdebug.repro: a standalone plain-torch script reproducing a NaN or a failing op, run in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, Shadow
from zoo import BROKEN, ZOO


def _run_script(path) -> subprocess.CompletedProcess:
    """A fresh interpreter, started outside the repository, with no fxdebug on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return subprocess.run([sys.executable, "-I", str(path)], capture_output=True, text=True, cwd=path.parent,
                          env=env, timeout=300)


class LossScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return torch.log(x[:, :1] + 1.0) + h


def _no_user_code(path) -> None:
    text = path.read_text()
    assert "fxdebug" not in text.split('"""', 2)[2]  # only the docstring mentions fxdebug
    assert "zoo" not in text and "test_repro" not in text


def test_planted_nan_reproduces_in_a_fresh_process(tmp_path):
    x = torch.rand(3, 8)
    x[1, 0] = -4.0
    dbg = fxdebug.instrument(LossScale(), [NaNCheck()], example_inputs=(torch.rand(3, 8),))
    rep = fxdebug.repro(dbg, (x,), tmp_path / "nan_repro.py")
    assert rep.node == "log" and rep.kind == "nonfinite" and rep.reproduced
    assert rep.nodes == ["log"]  # the op alone is enough
    assert rep.tensors == tmp_path / "nan_repro.pt" and rep.tensors.exists()
    _no_user_code(rep.path)
    done = _run_script(rep.path)
    assert done.returncode == 1, done.stderr
    assert "reproduced" in done.stdout and "'log'" in done.stdout and "1 NaN" in done.stdout


def test_a_live_module_is_reproduced_from_a_snapshot_graph(tmp_path):
    """A Dynamo capture's own graph is empty (it said "nothing to reproduce"): the model is traced once more."""
    x = torch.rand(3, 8)
    x[1, 0] = -4.0
    dbg = fxdebug.instrument(LossScale(), [NaNCheck()], example_inputs=(torch.rand(3, 8),), frontend="dynamo")
    rep = fxdebug.repro(dbg, (x,), tmp_path / "live.py")
    assert rep.node == "log" and rep.kind == "nonfinite" and rep.reproduced and rep.nodes == ["log"]
    _no_user_code(rep.path)


def test_shape_failure_reproduces_in_a_fresh_process(tmp_path):
    model, (x,) = BROKEN["mnist_mismatch"]()
    dbg = fxdebug.trace(model)
    rep = fxdebug.repro(dbg, (x,), tmp_path / "shape.py")
    assert rep.node == "fc1" and rep.kind == "error" and rep.reproduced
    assert "1440" in rep.message
    _no_user_code(rep.path)
    done = _run_script(rep.path)
    assert done.returncode == 1, done.stderr
    assert "RuntimeError" in done.stdout and "2x1440 and 1000x50" in done.stdout


class Broadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).expand(4, 8)
        h.add_(1.0)  # writes into a broadcast view: fails only on the expanded tensor itself
        return h


def test_grows_toward_the_inputs_when_the_op_alone_does_not_reproduce(tmp_path):
    dbg = fxdebug.trace(Broadcast())
    rep = fxdebug.repro(dbg, (torch.rand(1, 8),), tmp_path / "grow.py")
    assert rep.node == "add_" and rep.reproduced
    assert rep.nodes == ["expand", "add_"]  # a saved copy of the view is a plain tensor: expand is needed
    done = _run_script(rep.path)
    assert done.returncode == 1 and "memory location" in done.stdout


def test_script_exits_0_when_the_failure_is_gone(tmp_path):
    x = torch.rand(3, 8)
    x[0, 0] = -2.0
    dbg = fxdebug.instrument(LossScale(), [NaNCheck()], example_inputs=(torch.rand(3, 8),))
    rep = fxdebug.repro(dbg, (x,), tmp_path / "fixed.py")
    saved = torch.load(rep.tensors, weights_only=True)
    saved = {k: v.clamp_min(0.5) if v.is_floating_point() else v for k, v in saved.items()}  # "the fix"
    torch.save(saved, rep.tensors)
    done = _run_script(rep.path)
    assert done.returncode == 0 and "not reproduced" in done.stdout


def test_clean_inputs_have_nothing_to_reproduce(tmp_path):
    model, inputs = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=inputs)
    with pytest.raises(fxdebug.FxDebugError, match="nothing to reproduce"):
        fxdebug.repro(dbg, inputs, tmp_path / "none.py")
    assert not (tmp_path / "none.py").exists()
    with pytest.raises(fxdebug.UsageError):
        fxdebug.repro(model, inputs, tmp_path / "x.py")


def test_module_call_becomes_plain_torch_ops(tmp_path):
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    with torch.no_grad():
        model.layer2[0].bn1.running_var.fill_(-1.0)  # a corrupted checkpoint: sqrt of a negative variance
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,))
    rep = fxdebug.repro(dbg, (x,), tmp_path / "bn.py")
    assert rep.node == "layer2_0_bn1" and rep.reproduced
    text = rep.path.read_text()
    assert "batch_norm" in text and "running_var" in text
    done = _run_script(rep.path)
    assert done.returncode == 1 and "NaN" in done.stdout


def test_fp16_attention_overflow_in_tiny_gpt2(tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight.mul_(3000.0)  # queries and keys far too large for fp16
    model = model.half()
    ids = torch.randint(0, 100, (2, 8))
    dbg = fxdebug.instrument(model, [NaNCheck(), Shadow()], example_inputs={"input_ids": ids})
    dbg(input_ids=ids)
    report = dbg.report()
    origin = report.first_nonfinite
    assert report.row(origin)["module"].startswith("transformer.h.1.attn")
    assert report.precision_origin == origin and report.row(origin)["acc_err"] == float("inf")
    rep = fxdebug.repro(dbg, {"input_ids": ids}, tmp_path / "gpt2.py")
    # a live module's repro is cut from a snapshot graph of the model (export's `matmul_2`, where Dynamo's row
    # says `transformer_h_1_attn_matmul`): the same op of the same module either way
    assert rep.reproduced and (rep.node == origin or dbg.trace_info.frontend == "dynamo")
    head = rep.path.read_text().split('"""')[1]
    assert f"node '{rep.node}' (module {report.row(origin)['module']}, " in head and "matmul" in rep.node
    done = _run_script(rep.path)
    assert done.returncode == 1 and "Inf" in done.stdout


class NormAfterView(nn.Module):
    """A batch-norm (traced by recording its ops) fed by an op inside the grown subgraph."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        h = x.expand(3, 4)
        y = self.bn(h)
        h.add_(y)  # fails only on the expanded view: the subgraph grows to expand and the batch-norm
        return h


def test_grown_subgraph_with_a_recorded_module(tmp_path):
    model = NormAfterView().eval()
    dbg = fxdebug.trace(model)
    rep = fxdebug.repro(dbg, (torch.rand(1, 4),), tmp_path / "view.py")
    assert rep.node == "add_" and rep.nodes == ["expand", "bn", "add_"] and rep.reproduced
    assert "batch_norm" in rep.path.read_text()
    done = _run_script(rep.path)
    assert done.returncode == 1 and "memory location" in done.stdout
