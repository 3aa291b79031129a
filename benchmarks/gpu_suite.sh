#!/usr/bin/env bash
# The GPU rows of BENCHMARKS.md in one go, on a machine with one NVIDIA GPU whose
# Python has JAX (CUDA), PyTorch (CUDA) and what benchmarks/gpu.py imports:
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [OLD_SRC] [--tiny]
#
# Each step writes its JSON lines to OUT_DIR/gpu.jsonl as it measures and its output to
# OUT_DIR/suite.log, under a time limit of its own (a step that fails or times out
# leaves the others theirs):
#   1. JAX float32, 2. JAX mixed_bfloat16: plain fit, Keras's built-in accumulation,
#      gradaccum.accumulate and its one-step form side by side (benchmarks/gpu.py);
#   3. with OLD_SRC (another checkout's src/), JAX float32 plain against that
#      gradaccum's accumulate: before and after, each against plain fit in its run;
#   4. PyTorch float32, as 1;
#   5. the main job (gradaccum sweep, 10 runs of each configuration) on JAX, from the
#      MNIST IDX files in .mnist/ (when there), its worker processes by default;
#   6. JAX peak memory, each contender in a process of its own.
# The most wanted first: a time limit on the whole cuts the last.
set -u
out="$1"
shift
old=""
if [ $# -gt 0 ] && [ "$1" != "--tiny" ]; then
  old="$1"
  shift
fi
extra=("$@")
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mkdir -p "$out"
log="$out/suite.log"
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/gradaccum-jax-cache}"
limit="${GPU_SUITE_LIMIT:-150}"
[ ${#extra[@]} -gt 0 ] && limit=120

step() {
  local name="$1"
  shift
  local started=$SECONDS
  echo "== $name" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "== $name: exit $? after $((SECONDS - started)) s" | tee -a "$log"
}

bench=(python3 benchmarks/gpu.py --out "$out/gpu.jsonl" ${extra[@]+"${extra[@]}"})
three=(--contenders plain,builtin,accumulate)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$log" 2>&1
# On JAX also the one compiled step against the two chosen on the host (issue 54).
four=(--contenders plain,builtin,accumulate,accumulate_one_step)
step "jax float32" env KERAS_BACKEND=jax "${bench[@]}" "${four[@]}"
step "jax mixed_bfloat16" env KERAS_BACKEND=jax "${bench[@]}" "${four[@]}" \
  --precision mixed_bfloat16
if [ -n "$old" ]; then
  step "jax float32, gradaccum from $old" env KERAS_BACKEND=jax GRADACCUM_SRC="$old" \
    "${bench[@]}" --contenders plain,accumulate
fi
step "torch float32" env KERAS_BACKEND=torch "${bench[@]}" "${three[@]}"
if [ -d .mnist ]; then
  runs=(--runs 10)
  [ ${#extra[@]} -gt 0 ] && runs=(--runs 2 --updates 20)
  step "the main job on JAX" env PYTHONPATH="$root/src:${PYTHONPATH:-}" \
    python3 -c "import sys; from gradaccum.cli import main; sys.exit(main())" \
    sweep --backend jax --data .mnist --out "$out/sweep" "${runs[@]}"
fi
step "jax memory" env KERAS_BACKEND=jax "${bench[@]}" --memory \
  --contenders plain,accumulate,plain_kb
