"""CLI parts of the training tools: ``--version``, ``check --grads``, findings and progress from collect()."""

from __future__ import annotations

import textwrap

import pytest
import torch

import fxdebug
from fxdebug.cli.main import main

MODELS = textwrap.dedent('''
    import torch
    from torch import nn

    class Deep(nn.Module):
        """Ten sigmoid layers with small weights: gradients vanish towards the input."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            layers = []
            for _ in range(10):
                lin = nn.Linear(16, 16)
                with torch.no_grad():
                    lin.weight.normal_(0, 0.125)
                    lin.bias.zero_()
                layers += [lin, nn.Sigmoid()]
            self.body = nn.Sequential(*layers)
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            return self.head(self.body(x))
''')


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    return str(path)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"fxdebug {fxdebug.__version__}"


def test_check_grads_finds_vanishing_gradients(target, tmp_path, capsys):
    code = main(["check", f"{target}:Deep", "--input", "8,16", "--grads", "--batches", "3", "--json",
                 str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == 0  # vanishing gradients are a warning, not a broken model
    assert "parameter gradients vanish at and below body.4" in out and "Fix:" in out
    assert "3/3 batches" in err and "NaN/Inf nodes 0" in err
    import json

    rows = {r["node"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert rows["head"]["param_grad_calls"] == 3 and rows["head"]["grad_norm"] > 0


def test_check_data_reads_every_batch(target, tmp_path, capsys):
    torch.save([torch.randn(4, 16) for _ in range(7)], tmp_path / "b.pt")
    assert main(["check", f"{target}:Deep", "--data", str(tmp_path / "b.pt")]) == 0
    out = capsys.readouterr().out
    assert "7 call(s)" in out and "result: ok (7 batch(es) checked)" in out
