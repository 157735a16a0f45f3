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
    assert g.graph["first_nonfinite"] == "log"
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
