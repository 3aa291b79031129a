#!/usr/bin/env bash
# The test command of the README: sets up .venv with the standard TensorFlow wheel,
# KerasHub and the test tools, then runs ruff and pytest (tests/ and the doctests of
# src/gradaccum) in two worker processes (pytest-xdist).
#
#   bash scripts/test.sh          the whole suite; ends with its 15 slowest tests (CI)
#   bash scripts/test.sh --fast   the fast tier: tests not marked `slow` (tests/tiers.py),
#                                 few hypothesis examples (a few minutes)
#
# Other arguments go to pytest (`bash scripts/test.sh --fast -k split -x`; `-n 0` for one
# process; a `-m` of your own replaces the tier's).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRADACCUM_EXTRAS=tf,experiment,test,hub source "$root/scripts/setup.sh"
cd "$root"
python -m ruff check .
tier=(--durations=15)
args=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then
    tier=(-m "not slow" --hypothesis-profile=fast)
  else
    args+=("$arg")
  fi
done
exec python -m pytest -n "${GRADACCUM_TEST_WORKERS:-2}" "${tier[@]}" ${args[@]+"${args[@]}"}
