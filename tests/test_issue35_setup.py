"""Issue 35: the demo command installs only what the demo needs; the test command the rest.

Checked by the set-up's dry run (``FXDEBUG_SETUP_DRY_RUN=1`` prints each install command instead of
running it) with a Python that has nothing (``/bin/false``: every "already there?" check fails)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _dry_run(*args: str) -> str:
    env = {**os.environ, "FXDEBUG_SETUP_DRY_RUN": "1", "PYTHON": "/bin/false"}
    done = subprocess.run(["bash", str(ROOT / "tools" / "setup.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


@pytest.mark.skipif(not Path("/bin/false").exists(), reason="needs /bin/false")
def test_demo_set_up_is_torch_dot_and_fxdebug_only() -> None:
    demo = _dry_run("demo")
    assert "pip install -q torch==2.13.0" in demo
    assert re.search(r"pip install -q -e \.$", demo, flags=re.M)
    assert "[test]" not in demo and "chromium" not in demo
    full = _dry_run("test")
    assert "pip install -q torch==2.13.0" in full and "pip install -q -e .[test]" in full
    assert full.index("torch==2.13.0") < full.index(".[test]")  # torch first: nothing pulls another torch
    assert _dry_run() == full  # the default is the full set-up


def test_the_commands_call_the_set_up_they_need() -> None:
    assert "bash tools/setup.sh demo" in (ROOT / "tools" / "demo.sh").read_text()
    assert "bash tools/setup.sh test" in (ROOT / "tools" / "test.sh").read_text()
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme.split("## The two commands", 1)[1], flags=re.S)[:2]
    assert commands == ["bash tools/demo.sh", "bash tools/test.sh"]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == commands[1]  # CI runs exactly the README's test command
