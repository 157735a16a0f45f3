"""Choosing the observation kernel (``FXDEBUG_KERNEL``), the report's note saying which ran, and
the C++ build's cache name (B9: keyed by the source and the torch version; it says when building)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxdebug
from fxdebug.errors import UsageError
from fxdebug.passes import NaNCheck, StatCollector
from fxdebug.runtime import kernel

ROOT = Path(__file__).resolve().parent.parent


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return m, (torch.randn(3, 4),)


def test_unknown_kernel_name_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("FXDEBUG_KERNEL", "cuda-graphs")
    with pytest.raises(UsageError, match="cpp, triton, torch"):
        kernel.requested()
    monkeypatch.setenv("FXDEBUG_KERNEL", "C++")
    assert kernel.requested() == "cpp"
    with pytest.raises(UsageError):
        with kernel.use("numpy"):
            pass


def test_use_switches_the_kernel_and_the_report_says_which_ran():
    m, x = _model()
    dbg = fxdebug.instrument(m, [NaNCheck(mode="record"), StatCollector()], example_inputs=x)
    dbg(*x)
    native = dbg.report()
    assert kernel.active("cpu") == "c++"
    assert "runtime: observation kernel c++ on cpu" in native.notes
    dbg.reset()
    with kernel.use("torch") as name:
        assert name == kernel.active("cpu") == "torch"
        dbg(*x)
        ours = dbg.report()
    assert kernel.active("cpu") == "c++"  # restored
    assert any(n.startswith("runtime: observation kernel torch on cpu") for n in ours.notes)
    observed = [(a, b) for a, b in zip(native.rows, ours.rows) if "count" in a]
    assert len(observed) >= 3
    for a, b in observed:
        assert a["count"] == b["count"] and a["calls"] == b["calls"] and a["nonfinite_calls"] == b["nonfinite_calls"]
        assert a["mean"] == pytest.approx(b["mean"], rel=1e-6, abs=1e-9)
    # after the block the C++ kernel observes again (the override was removed from the dispatcher)
    dbg.reset()
    dbg(*x)
    assert "runtime: observation kernel c++ on cpu" in dbg.report().notes


def _subprocess(env_extra: dict[str, str]) -> list[str]:
    code = (
        "import torch, fxdebug\n"
        "from fxdebug.passes import NaNCheck, StatCollector\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "x = torch.randn(2, 4)\n"
        "dbg = fxdebug.instrument(m, [NaNCheck(), StatCollector()], example_inputs=(x,))\n"
        "dbg(x)\n"
        "r = dbg.report()\n"
        "print(fxdebug.runtime.kernel.active('cpu'))\n"
        "print(r.row('_1')['count'])\n"
        "print([n for n in r.notes if n.startswith('runtime:')][0])\n"
    )
    env = dict(os.environ, **env_extra)
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_fxdebug_kernel_torch_is_chosen_and_named():
    kind, count, note = _subprocess({"FXDEBUG_KERNEL": "torch"})
    assert kind == "torch" and count == "8"
    assert "observation kernel torch on cpu" in note and "FXDEBUG_KERNEL=torch" in note


def test_triton_on_cpu_without_the_interpreter_falls_back_and_says_why():
    pytest.importorskip("triton")
    kind, count, note = _subprocess({"FXDEBUG_KERNEL": "triton"})
    assert kind == "torch" and count == "8"
    assert "TRITON_INTERPRET=1" in note


def test_build_name_is_keyed_by_source_and_torch_version(tmp_path, monkeypatch):
    name, flags = kernel.build_name()
    assert name.startswith("fxdebug_observe") and len(name.rsplit("_", 1)[1]) == 12
    assert kernel.build_name() == (name, flags)  # stable
    src = tmp_path / "observe.cpp"
    src.write_bytes(kernel._SOURCES[0].read_bytes() + b"\n// another checkout\n")
    monkeypatch.setattr(kernel, "_SOURCES", [src])
    other_source = kernel.build_name()[0]
    assert other_source != name
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert kernel.build_name()[0] not in (name, other_source)


def test_a_build_says_so(monkeypatch, capsys):
    from torch.utils import cpp_extension

    seen = {}
    monkeypatch.setattr(kernel, "_built", lambda name: False)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.update(kw))
    kernel._build()
    err = capsys.readouterr().err
    assert "building the C++ observation kernel" in err and seen["name"] in err
    # built from a copy named by the build, not from this checkout's path: two checkouts share one build
    (src,) = seen["sources"]
    assert seen["name"] in src and Path(src).read_bytes() == kernel._SOURCES[0].read_bytes()
    monkeypatch.setattr(kernel, "_built", lambda name: True)
    kernel._build()
    assert capsys.readouterr().err == ""  # a cached build loads quietly
