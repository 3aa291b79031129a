#!/usr/bin/env bash
# The main job of the README: sets up .venv, then runs a short example training.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
exec python examples/custom_loop.py "$@"
