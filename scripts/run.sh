#!/usr/bin/env bash
# The main job of the README: sets up .venv with what the seed experiment needs on its
# backend, then runs it (`gradaccum sweep`: the source's four k x b configurations, 10
# runs each, plus plain training at b=5) on the default data. Extra arguments go to the
# sweep.
#
# The backend: `--backend` among the arguments, else KERAS_BACKEND, else JAX (the
# fastest on a CPU; BENCHMARKS.md). It installs only that backend: JAX (`jax` extra),
# tensorflow-cpu (`cpu`), or PyTorch (torch==2.13.0, as test.sh: the CPU build where
# pip's configured wheels hold it, as on the project's machines; on PyPI's Linux index
# it is the CUDA build, so elsewhere set GRADACCUM_TORCH="torch --index-url
# https://download.pytorch.org/whl/cpu"); with the `experiment` extra (tqdm, matplotlib).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
backend="${KERAS_BACKEND:-jax}"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --backend) backend="${args[i + 1]:-}" ;;
    --backend=*) backend="${args[i]#--backend=}" ;;
  esac
done
case "$backend" in
  jax) extras=jax,experiment ;;
  tensorflow) extras=cpu,experiment ;;
  torch) extras=experiment ;;
  *) echo "run.sh: the backend must be jax, tensorflow or torch, got '$backend'" >&2; exit 2 ;;
esac
GRADACCUM_EXTRAS=$extras source "$root/scripts/setup.sh"
if [ "$backend" = torch ] && ! python -c "import torch" >/dev/null 2>&1; then
  # (Unquoted: GRADACCUM_TORCH may hold pip options.)
  # shellcheck disable=SC2086
  python -m pip install --quiet ${GRADACCUM_TORCH:-torch==2.13.0}
fi
cd "$root"
exec gradaccum sweep --backend "$backend" "$@"
