#!/usr/bin/env bash
# The main job of the README: sets up .venv with what the seed experiment needs
# (tensorflow-cpu and the `experiment` extra; nothing for the tests), then runs it
# (`gradaccum sweep`: the source's four k x b configurations, 10 runs each, plus plain
# training at b=5) on the default data. Extra arguments go to the sweep.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRADACCUM_EXTRAS=cpu,experiment source "$root/scripts/setup.sh"
cd "$root"
exec gradaccum sweep "$@"
