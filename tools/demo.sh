#!/usr/bin/env bash
# The main job: set up what the demo needs (idempotent: torch 2.13.0, graphviz's `dot`, fxdebug
# itself without the test extras), then run the demo — instrument a bundled model with planted
# problems, print the report, write demo.svg. tools/test.sh installs the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh demo
exec "${PYTHON:-python3}" -m fxdebug demo "$@"
