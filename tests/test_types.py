"""``mypy`` reports no error in the package (configured in pyproject.toml's ``[tool.mypy]``).

The package ships ``py.typed``, so its annotations are a promise to users' type checkers. CI
installs the ``test`` extra, which includes mypy; without mypy the test is skipped. A cold run
takes ~15-50 s (two shared cores); mypy's cache (``.mypy_cache/``) makes reruns a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_reports_no_error_in_the_package():
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install 'fxdebug[test]')")
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), str(ROOT / "fxdebug")])
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 0 and not errors, "mypy found errors:\n" + "\n".join(errors[:40]) + f"\n{stderr}"
