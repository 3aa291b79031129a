#!/usr/bin/env bash
# Creates .venv (once) and installs gradaccum with what one job needs. Sourced by run.sh
# and test.sh with the extras that job needs; safe to run again.
#
#   run.sh  -> jax,experiment         (JAX, tqdm, matplotlib; cpu,experiment on TensorFlow)
#   test.sh -> tf,experiment,test,hub (the standard tensorflow wheel: KerasHub's
#              tensorflow-text needs it rather than tensorflow-cpu; pytest & co.)
#
# The venv only grows: the stamp holds the extras installed, and a job whose extras are
# already there (the standard wheel stands in for `cpu`) installs nothing. A change of
# pyproject.toml installs again.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GRADACCUM_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
wanted="${GRADACCUM_EXTRAS:-jax,experiment}"
wanted="${wanted// /}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
stamp="$venv/.gradaccum-installed"
installed=""
stale=0
if [ -f "$stamp" ]; then
  installed="$(cat "$stamp")"
  [ "$root/pyproject.toml" -nt "$stamp" ] && stale=1
fi
# An install that did not finish left its extras here: they are wanted again.
pending=""
if [ -f "$stamp.pending" ]; then
  pending="$(cat "$stamp.pending")"
  stale=1
fi
# The union of what is installed and what is wanted; `tf` or `gpu` replaces `cpu` (the
# wheels own the same files).
extras="$(printf '%s\n' "${installed//,/$'\n'}" "${pending//,/$'\n'}" "${wanted//,/$'\n'}" \
  | sed '/^$/d' | sort -u)"
if grep -qx -e tf -e gpu <<<"$extras"; then
  extras="$(grep -vx cpu <<<"$extras" || true)"
fi
extras="$(paste -sd, <<<"$extras")"
if [ "$extras" != "$installed" ] || [ "$stale" = 1 ]; then
  # Until the install below succeeds the venv is in between: the next run of either
  # script installs these extras again.
  echo "$extras" >"$stamp.pending"
  "${pip[@]}" install --quiet --upgrade pip
  # tensorflow-cpu and tensorflow own the same files: installing one over the other, or
  # removing one of the two, leaves a broken package. Going from `cpu` to `tf`, remove
  # both, then install the standard wheel alone.
  if [[ ",$extras," == *,tf,* || ",$extras," == *,gpu,* ]] \
      && "${pip[@]}" show --quiet tensorflow-cpu >/dev/null 2>&1; then
    old=(tensorflow-cpu)
    if "${pip[@]}" show --quiet tensorflow >/dev/null 2>&1; then
      old+=(tensorflow)
    fi
    "${pip[@]}" uninstall --quiet --yes "${old[@]}"
  fi
  "${pip[@]}" install --quiet -e "$root[$extras]"
  echo "$extras" >"$stamp"
  rm -f "$stamp.pending"
fi
export PATH="$venv/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
