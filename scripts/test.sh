#!/usr/bin/env bash
# The test command of the README: sets up .venv, then runs the whole suite
# (tests/ and the doctests of src/gradaccum). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
python -m ruff check .
exec python -m pytest "$@"
