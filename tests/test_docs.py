"""Every Python example in the README and the docs that no other test runs, run as written
(in a scratch directory, with the README's `model` and `x` supplied by the zoo)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from zoo import ZOO

ROOT = Path(__file__).resolve().parent.parent


def _blocks(relative: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / relative).read_text(), flags=re.S)


def _run(code: str, namespace: dict, name: str) -> dict:
    exec(compile(code.replace("print(", "_ = ("), name, "exec"), namespace)
    return namespace


def test_readme_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    ns = _run(_blocks("README.md")[0], {"model": model, "x": x}, "README.md")
    assert torch.equal(ns["y"], model(x))
    assert ns["dbg"].report().first_nonfinite is None
    assert (tmp_path / "model.svg").exists() and (tmp_path / "model.dot").exists()


def test_cli_doc_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for block in _blocks("docs/cli.md"):
        _run(block, ns, "cli.md")
    assert (tmp_path / "model.svg").exists() and (tmp_path / "plain.svg").exists()
    g = ns["g"]
    origin = g.graph["first_nonfinite"]  # head's torch.log: `log` in a symbolic graph, `head_log` in Dynamo's
    assert origin in ("log", "head_log") and g.nodes[origin]["module"] == "head"
    assert g.nodes["stage2_act"]["stats"]["dead_frac"] >= 0.5


def test_frontends_doc_examples():
    ns: dict = {}
    for block in _blocks("docs/frontends.md"):
        _run(block, ns, "frontends.md")
    assert ns["info"].frontend == "subtrees"


def test_autograd_doc_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for block in _blocks("docs/autograd.md"):
        _run(block, ns, "autograd.md")
    assert ns["error"].saved_by == "sigmoid" and ns["hit"].node == "sqrt" and ns["drawn"].channels == 6


def test_distributed_doc_example_under_torchrun(tmp_path):
    """docs/distributed.md's train.py, run as written under torchrun with two CPU processes."""
    import os
    import socket
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(_blocks("docs/distributed.md")[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    def run() -> tuple[int, str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "train.py"]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        return proc.returncode, out

    code, out = run()
    # once in ~15 runs on the loaded 2-core machine a rank aborted at interpreter exit ("terminate called without an
    # active exception", C++ threads torn down) after the script had printed everything: run it once more then
    if code != 0 and "terminate called without an active exception" in out and "from 256 values" in out:
        code, out = run()
    assert code == 0, out
    assert "origin: call 2, rank 1, node 'sqrt'" in out, out
    assert "each rank alone: ['fc1', 'sqrt']" in out and "from 256 values" in out, out


def test_training_doc_walkthrough(tmp_path, monkeypatch):
    """docs/training.md: collect with a progress bar, findings, both plots, TensorBoard, reversal, freezing."""
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for block in _blocks("docs/training.md"):
        _run(block, ns, "training.md")
    for name in ("training-gradient-flow.png", "training-activations.png", "training-gradient-flow-fixed.png",
                 "training-sensitivity.svg"):
        assert (tmp_path / name).stat().st_size > 1000, name
    assert ns["written"] > 50 and any((tmp_path / "runs" / "fxdebug").iterdir())
    assert [f.kind for f in ns["report"].findings()] == ["dead_activations", "vanishing_gradients"]
    assert ns["fixed"].findings() == [] and ns["slowest"]["time_ms"] > 0


def test_faithful_doc_example():
    """docs/faithful.md: an STE, a no_grad teacher and dropout, instrumented in eval, verified in both modes."""
    ns = _run(_blocks("docs/faithful.md")[0], {}, "faithful.md")
    assert ns["result"].ok and ns["result"].modes == ("train", "eval")
    assert ns["model"].teacher.weight.grad is None and ns["model"].student.weight.grad is not None
    assert ns["dbg"].training


def test_numerics_doc_examples(tmp_path, monkeypatch):
    """docs/numerics.md: Shadow names the cancellation, the plan fixes it, diff finds it, the recorder
    keeps the calls before a NaN and repro's script reproduces it in a fresh process."""
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for block in _blocks("docs/numerics.md"):
        _run(block, ns, "numerics.md")
    assert ns["report"].precision_origin == "sub" and "sub" in ns["plan"].nodes
    assert ns["d"].first_divergent == "sub"
    assert ns["rep"].reproduced and ns["done"].returncode == 1 and (tmp_path / "nan_repro.pt").exists()
