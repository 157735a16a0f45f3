#!/usr/bin/env bash
# The main job: set up (idempotent), then run the demo — instrument a bundled model with planted
# problems, print the report, write demo.svg.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec "${PYTHON:-python3}" -m fxdebug demo "$@"
