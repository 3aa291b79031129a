#!/usr/bin/env bash
# Creates .venv (once) and installs gradaccum with the standard TensorFlow wheel, KerasHub
# (with tensorflow-text, which needs that wheel rather than tensorflow-cpu), the experiment
# and the test extras. Sourced by run.sh and test.sh; safe to run again.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GRADACCUM_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
extras="tf,experiment,test,hub"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
# The stamp holds the extras installed: a change of extras or of pyproject.toml reinstalls.
stamp="$venv/.gradaccum-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] \
    || [ "$(cat "$stamp")" != "$extras" ]; then
  "${pip[@]}" install --quiet --upgrade pip
  # tensorflow-cpu (installed here before KerasHub) and tensorflow own the same files:
  # installing one over the other, or removing one of the two, leaves a broken package.
  # Remove both, then install the standard wheel alone.
  if "${pip[@]}" show --quiet tensorflow-cpu >/dev/null 2>&1; then
    old=(tensorflow-cpu)
    if "${pip[@]}" show --quiet tensorflow >/dev/null 2>&1; then
      old+=(tensorflow)
    fi
    "${pip[@]}" uninstall --quiet --yes "${old[@]}"
  fi
  "${pip[@]}" install --quiet -e "$root[$extras]"
  echo "$extras" >"$stamp"
fi
export PATH="$venv/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
