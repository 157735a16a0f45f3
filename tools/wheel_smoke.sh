#!/usr/bin/env bash
# Build the wheel, install it (not editable) into a fresh venv, and use it from outside the
# checkout: an editable install once hid a subpackage missing from the wheel.
# The venv sees the system site-packages only for torch and the other dependencies; the check
# below fails if `fxdebug` resolves anywhere but the venv's own copy.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" . >/dev/null
"$PY" -m venv --system-site-packages "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --no-deps --no-index "$WORK"/dist/fxdebug-*.whl
cp tools/wheel_smoke.py "$WORK/smoke.py"
cd "$WORK" && "$WORK/venv/bin/python" smoke.py "$WORK/venv"
