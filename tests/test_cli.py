"""The command line, end to end: subprocesses for the main paths (their exit codes are the
contract for users' CI), in-process ``main()`` for the error messages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest
import torch

from fxdebug.cli.main import main
from fxdebug.render.dot import COLORS

SVG = "{http://www.w3.org/2000/svg}"
TARGETS = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Logs(nn.Module):
        def forward(self, x):
            return torch.log(x) * 2

    class Mismatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 10, 5)
            self.fc1 = nn.Linear(1000, 50)

        def forward(self, x):
            x = torch.relu(self.conv(x))
            return self.fc1(x.view(x.size(0), -1))

    class Dead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.act = nn.ReLU()
            nn.init.constant_(self.fc.bias, -100.0)

        def forward(self, x):
            return self.act(self.fc(x))

    class NeedsArgs(nn.Module):
        def __init__(self, width):
            super().__init__()

    def make():
        return Net()

    net = Net()
    not_a_module = 3
""")


@pytest.fixture
def targets(tmp_path):
    path = tmp_path / "targets.py"
    path.write_text(TARGETS)
    return str(path)


def run(*args, cwd):
    env = dict(os.environ, FXDEBUG_TEST_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fxdebug", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def fills(path):
    out = {}
    for g in ET.parse(path).getroot().iter(f"{SVG}g"):
        if g.get("class") == "node":
            shape = next(e for e in g.iter() if e.tag in (f"{SVG}path", f"{SVG}polygon", f"{SVG}ellipse"))
            out[g.find(f"{SVG}title").text] = shape.get("fill")
    return out


def test_demo_prints_the_planted_problems_and_writes_the_svg(tmp_path):
    proc = run("demo", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # node names and op labels as the default frontend gives them: symbolic (`log`, ReLU) or Dynamo (`head_log`, F.relu)
    origin = re.search(r"NaN/Inf origin \(forward\): node '(log|head_log)' \(module head, torch\.log\)", out)
    assert origin, out
    assert re.search(r"dead channels: node 'stage2_act' \(module stage2\.act, (ReLU|F\.relu)\): 75%", out), out
    assert "SwapActivation(only_dead=0.5)" in out
    svg = fills(tmp_path / "demo.svg")
    assert svg[origin.group(1)] == COLORS["origin"] and svg["stage2_act"] == COLORS["hot"]
    assert (tmp_path / "demo.dot").exists()


def test_render_a_file_target(targets, tmp_path):
    proc = run("render", f"{targets}:make", "--input", "2,4", "-o", "g.svg", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert {"x", "fc", "relu", "output"} <= set(fills(tmp_path / "g.svg"))


def test_render_names_the_node_that_rejects_the_input(targets, tmp_path):
    proc = run("render", f"{targets}:Mismatch", "--input", "2,1,28,28", "-o", "g.svg", cwd=tmp_path)
    assert proc.returncode == 1
    assert "fc1" in proc.stderr and "set in_features=5760" in proc.stderr
    assert fills(tmp_path / "g.svg")["fc1"] == COLORS["failed"]


def test_check_exits_1_on_nan_and_writes_json(targets, tmp_path):
    proc = run("check", f"{targets}:Logs", "--input", "3,4", "--nan", "--stats", "--batches", "3",
               "--json", "r.json", "-o", "c.svg", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "3/3 batches" in proc.stderr  # the progress indicator
    assert "PROBLEM FOUND" in proc.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["first_nonfinite"] == "log" and data["failed"] is None
    assert fills(tmp_path / "c.svg")["log"] == COLORS["origin"]


def test_check_exits_0_on_a_healthy_model_with_a_data_file(targets, tmp_path):
    torch.save([torch.randn(2, 4), torch.randn(5, 4)], tmp_path / "batches.pt")
    proc = run("check", f"{targets}:net", "--data", "batches.pt", "--shapes", "--nan", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: ok (2 batch(es) checked)" in proc.stdout


def test_check_does_not_say_ok_under_a_dead_layer(targets, tmp_path):
    """`check` printed "result: ok" under a 100%-dead finding."""
    proc = run("check", f"{targets}:Dead", "--input", "8,4", "--stats", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # warnings are not a failed check
    assert "dead" in proc.stdout.lower()
    assert "result: ok" not in proc.stdout and "result: WARNINGS (dead_activations" in proc.stdout


@pytest.mark.parametrize("target, message", [
    ("no_such_pkg.models:Net", "cannot import module 'no_such_pkg.models'"),
    ("{file}:Nope", "has no attribute 'Nope'. It defines these modules: Dead, Logs, Mismatch, NeedsArgs, Net, net"),
    ("{file}:not_a_module", "is a int, not an nn.Module"),
    ("{file}:NeedsArgs", "needs arguments (width)"),
    ("just_a_name", "must look like 'pkg.module:attr'"),
])
def test_unloadable_targets_exit_2_with_a_sentence(targets, tmp_path, capsys, target, message):
    code = main(["render", target.format(file=targets), "--input", "2,4", "-o", str(tmp_path / "g.svg")])
    assert code == 2
    assert message in capsys.readouterr().err


def test_bad_input_shape_and_missing_input(targets, tmp_path, capsys):
    assert main(["render", f"{targets}:net", "--input", "2,x", "-o", str(tmp_path / "g.svg")]) == 2
    assert "is not a shape" in capsys.readouterr().err
    assert main(["check", f"{targets}:net"]) == 2
    assert "--input" in capsys.readouterr().err


def test_check_highlights_a_check_that_fails_mid_run(targets, tmp_path, capsys):
    torch.save([torch.randn(2, 4), torch.randn(2, 5)], tmp_path / "batches.pt")  # the second one is too wide
    code = main(["check", f"{targets}:net", "--data", str(tmp_path / "batches.pt"), "--json", str(tmp_path / "r.json"),
                 "-o", str(tmp_path / "c.svg")])
    assert code == 1
    captured = capsys.readouterr()
    # ShapeAssert stops it at the graph input, before the Linear sees it.
    assert "batch 2 failed a check" in captured.err and "node 'x'" in captured.err and "expected (N, 4)" in captured.err
    failed = json.loads((tmp_path / "r.json").read_text())["failed"]
    assert failed["node"] == "x" and failed["error"] == "ShapeMismatchError"
    svg = fills(tmp_path / "c.svg")
    assert svg["x"] == COLORS["failed"] and svg["fc"] == COLORS["op"]


def test_outputs_into_a_missing_directory_exit_2_before_any_work(targets, tmp_path, capsys):
    for argv in (["demo", "-o", str(tmp_path / "nodir" / "x.svg")],
                 ["render", f"{targets}:net", "--input", "2,4", "-o", str(tmp_path / "nodir" / "g.svg")],
                 ["check", f"{targets}:net", "--input", "2,4", "--json", str(tmp_path / "nodir" / "r.json")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "does not exist" in err and "nodir" in err and "Traceback" not in err


def test_check_data_reads_every_batch(targets, tmp_path):
    torch.save([torch.randn(2, 4) for _ in range(10)], tmp_path / "batches.pt")
    assert main(["check", f"{targets}:net", "--data", str(tmp_path / "batches.pt"), "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["calls"] == 10


def test_check_data_batch_that_does_not_fit_the_forward_exits_2(targets, tmp_path, capsys):
    batches = [(torch.randn(2, 4),)] * 2 + [(torch.randn(2, 4), torch.randn(2, 4))] + [(torch.randn(2, 4),)] * 2
    torch.save(batches, tmp_path / "batches.pt")
    assert main(["check", f"{targets}:net", "--data", str(tmp_path / "batches.pt")]) == 2
    err = capsys.readouterr().err
    assert "batch 3 of 5 does not fit the model" in err and "Traceback" not in err
