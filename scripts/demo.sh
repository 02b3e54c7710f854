#!/usr/bin/env bash
# The main job on a fresh machine: set up what is missing, then run the demo on a namespace
# testbed (4 workers, 16 MiB of float32 gradients, through the XDP and the user-space aggregator).
# Extra arguments go to `nicoffload demo` (e.g. --workers 8 --size 64MiB --sparsity 0.75).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NICOFFLOAD_EXTRAS="${NICOFFLOAD_EXTRAS:-test}" bash "$here/scripts/setup.sh"
exec "$here/.venv/bin/nicoffload" demo "$@"
