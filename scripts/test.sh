#!/usr/bin/env bash
# The test command of the README: sets up .venv with the standard TensorFlow wheel, JAX,
# KerasHub and the test tools, then runs ruff and pytest on each of Keras's backends
# gradaccum supports, one process per backend (Keras fixes its backend per process), each
# in two worker processes (pytest-xdist): TensorFlow runs tests/ and the doctests of
# src/gradaccum, JAX runs tests/jax_backend, PyTorch tests/torch_backend; all three run
# tests/contract. PyTorch is installed for its run only, when it comes (torch 2.13.0, the
# CPU build this machine keeps: GRADACCUM_TORCH sets another requirement).
#
#   bash scripts/test.sh          the whole suite; each backend's run ends with its 15
#                                 slowest tests (CI)
#   bash scripts/test.sh --fast   the fast tier: tests not marked `slow` (tests/tiers.py),
#                                 few hypothesis examples (a few minutes)
#
# Other arguments go to pytest (`bash scripts/test.sh --fast -k split -x`; `-n 0` for one
# process; a `-m` of your own replaces the tier's). GRADACCUM_BACKENDS chooses the
# backends (default "tensorflow jax torch"; `GRADACCUM_BACKENDS=torch bash scripts/test.sh`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRADACCUM_EXTRAS=tf,experiment,test,hub,docs source "$root/scripts/setup.sh"
cd "$root"
# Python may write bytecode: pytest keeps each test module with its asserts rewritten
# in __pycache__, so the next worker and the next backend's run reuse it (2 to 4 s of
# each worker's start where PYTHONDONTWRITEBYTECODE is set, as on this project's
# machines).
unset PYTHONDONTWRITEBYTECODE
python -m ruff check .
tier=(--durations=15)
fast=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then
    fast=1
    tier=(-m "not slow" --hypothesis-profile=fast)
  else
    args+=("$arg")
  fi
done
status=0
for backend in ${GRADACCUM_BACKENDS:-tensorflow jax torch}; do
  echo "== Keras backend: $backend =="
  paths=()
  workers="${GRADACCUM_TEST_WORKERS:-2}"
  if [ "$backend" = "jax" ]; then
    # Its own tests, and the contract tests every backend runs (tests/contract).
    paths=(tests/jax_backend tests/contract)
  elif [ "$backend" = "torch" ]; then
    if ! python -c "import torch" >/dev/null 2>&1; then
      echo "Installing PyTorch for its run (${GRADACCUM_TORCH:-torch==2.13.0})"
      python -m pip install --quiet "${GRADACCUM_TORCH:-torch==2.13.0}"
    fi
    paths=(tests/torch_backend tests/contract)
  fi
  KERAS_BACKEND="$backend" python -m pytest -n "$workers" "${tier[@]}" \
    ${paths[@]+"${paths[@]}"} ${args[@]+"${args[@]}"} || status=$?
done
exit "$status"
