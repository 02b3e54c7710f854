#!/usr/bin/env bash
# The test suite on a fresh machine: set up what is missing (including the optional torch extra,
# so the DDP tests run), then pytest: unit (no root), bpf (BPF_PROG_TEST_RUN), netns (namespaces).
# Extra arguments go to pytest (e.g. tests/unit -x).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NICOFFLOAD_EXTRAS="${NICOFFLOAD_EXTRAS:-test,bench,torch}" bash "$here/scripts/setup.sh"
cd "$here"
exec "$here/.venv/bin/python" -m pytest -q --durations=15 "$@"
