"""One of two PyTorch processes on localhost (`torch.distributed`, gloo on CPU)
training a Keras MLP (KERAS_BACKEND=torch) wrapped in `DistributedDataParallel`
with a custom loop, for tests/torch_backend/test_torch_ddp.py. Run as
`python ddp_job.py RANK PORT FOLDER`; writes `FOLDER/rank{RANK}.json`.

Each rank feeds micro-batches of its own sizes (`SIZES[rank]`: the ranks' shares
are unequal), `EPOCHS` passes over them, the window that is open at the end of a
pass applied with `acc.apply`. A communication hook around DDP's `allreduce_hook`
counts the all-reduces DDP makes itself. Modes, each on a fresh model and DDP:

- `steps`: `GradientAccumulator(steps=STEPS, noise_scale=True)`, each micro-batch's
  forward and backward inside `acc.no_sync(ddp)`, `acc.step(optimizer, grads,
  weight=len(x))`.
- `sharded`: `steps` with `sums="sharded"` (each rank keeps half of the sums,
  reduce-scattered per micro-batch); its state saved in the middle of the first
  pass's second window and loaded into a new accumulator, which goes on.
- `budget`: the same with `weight_per_update=BUDGET` (the global window's weight),
  `process_group=dist.group.WORLD` given.
- `overwrite`: `steps` with one more variable marked `overwrite_with_gradient`
  (float8's rule), handed `10 * rank + i` at micro-batch `i`: each window's value
  is the maximum over both ranks, not their sum.
- `builtin`: what users write without gradaccum: plain DDP backward per micro-batch
  (synchronized, DDP averages over the ranks) of `loss / window length`, the
  summed `.grad` applied every `STEPS` micro-batches (and at the end of a pass).

Per mode it writes the final weights, the optimizer's variables, the updates, and
per update the DDP all-reduces and gradaccum's all-reduces counted so far and the
window's recorded weight.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "contract"))
from largebatch import SCE, data, mlp  # noqa: E402

import gradaccum  # noqa: E402

# Micro-batch sizes per rank (one pass): rank 1's share of each window is larger.
# Global weight per micro-batch step: 8, 7, 6, 3, 9, 15, 6, 4.
SIZES = ([3, 1, 4, 1, 2, 5, 2, 1], [5, 6, 2, 2, 7, 10, 4, 3])
STEPS, BUDGET, EPOCHS, LEARNING_RATE = 3, 14, 2, 0.05


def micro_batch_rows(rank: int) -> list:
    """Row indices (into `data(sum of all sizes)`) of each micro-batch of `rank`:
    rank 0's rows first, then rank 1's."""
    start = sum(SIZES[0]) if rank else 0
    bounds = np.concatenate([[0], np.cumsum(SIZES[rank])]) + start
    return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


class HookCounter:
    """The state of a DDP communication hook that counts DDP's all-reduces."""

    def __init__(self):
        self.all_reduces = 0


def counting_allreduce_hook(state: HookCounter, bucket):
    state.all_reduces += 1
    return default_hooks.allreduce_hook(None, bucket)


def to_list(values) -> list:
    return [np.asarray(keras.ops.convert_to_numpy(v)).tolist() for v in values]


def train(mode: str, rank: int) -> dict:
    x, y = data(sum(map(sum, SIZES)))
    model = mlp(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    counter = HookCounter()
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    variables = model.trainable_weights
    optimizer.build(variables)
    acc = None
    marked = None
    if mode == "overwrite":
        marked = keras.Variable(0.0, name="marked")
        marked.overwrite_with_gradient = True
        variables = [*variables, marked]
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        optimizer.build(variables)
    if mode == "overwrite":
        acc = gradaccum.GradientAccumulator(variables, steps=STEPS)
    elif mode == "steps":
        acc = gradaccum.GradientAccumulator(variables, steps=STEPS, noise_scale=True)
    elif mode == "sharded":
        acc = gradaccum.GradientAccumulator(variables, steps=STEPS, sums="sharded",
                                            noise_scale=True)
    elif mode == "budget":
        # The group given explicitly (the same as "auto" here).
        acc = gradaccum.GradientAccumulator(variables, weight_per_update=BUDGET,
                                            process_group=dist.group.WORLD)
    log = {"ddp_all_reduces": [], "gradaccum_all_reduces": [], "window_weight": [],
           "reduce_scatters": [], "all_gathers": []}
    shard_sizes = []
    mid = {}

    def updated():
        log["ddp_all_reduces"].append(counter.all_reduces)
        log["gradaccum_all_reduces"].append(0 if acc is None else acc.all_reduces)
        log["reduce_scatters"].append(0 if acc is None else acc.reduce_scatters)
        log["all_gathers"].append(0 if acc is None else acc.all_gathers)
        log["window_weight"].append(
            None if acc is None else float(acc.last_window_weight.numpy()))

    rows = micro_batch_rows(rank)
    for _ in range(EPOCHS):
        for i, index in enumerate(rows):
            xb, yb = torch.as_tensor(x[index]), torch.as_tensor(y[index])
            if acc is not None:
                with acc.no_sync(ddp):
                    y_pred = ddp(xb, training=True)
                    loss = SCE(yb, y_pred)
                    ddp.zero_grad()
                    loss.backward()
                grads = [v.value.grad for v in variables if v is not marked]
                if marked is not None:
                    grads.append(torch.tensor(10.0 * rank + i))
                if bool(acc.step(optimizer, grads, weight=len(index))):
                    updated()
                if mode in ("steps", "sharded") and i == 4 and not mid:
                    # In the middle of the first pass's second window: the window's
                    # gradient as `gradients()` gives it (this rank's window with
                    # whole sums; both ranks' with sharded ones), and its weight.
                    mid["gradients"] = to_list(acc.gradients())
                    mid["total_weight"] = float(acc.total_weight.numpy())
                if mode == "sharded" and i == 4 and not shard_sizes:
                    # In the middle of a window: the state saved and loaded into a
                    # new accumulator (as a resumed job would), which goes on.
                    saved = {k: v.clone() for k, v in acc.state_dict().items()}
                    shard_sizes.append(int(saved["accumulator_shard"].numel()))
                    counts = (acc.all_reduces, acc.reduce_scatters, acc.all_gathers)
                    acc = gradaccum.GradientAccumulator(variables, steps=STEPS,
                                                        sums="sharded", noise_scale=True)
                    acc.load_state_dict(saved)
                    acc._reducer.all_reduces, acc._reducer.reduce_scatters, \
                        acc._reducer.all_gathers = counts
                continue
            # Plain DDP accumulation: backward synchronized per micro-batch, the
            # gradients summed in `.grad`, the window's micro-batches averaged.
            first = i - i % STEPS
            length = min(STEPS, len(rows) - first)
            y_pred = ddp(xb, training=True)
            loss = SCE(yb, y_pred) / length
            loss.backward()
            if i == first + length - 1:
                with torch.no_grad():
                    optimizer.apply([v.value.grad for v in variables], variables)
                ddp.zero_grad()
                updated()
        if acc is not None and bool(acc.apply(optimizer)):
            updated()
    return {
        "weights": to_list(model.get_weights()),
        "optimizer": to_list(optimizer.variables),
        "optimizer_paths": [v.path for v in optimizer.variables],
        "updates": None if acc is None else int(acc.updates.numpy()),
        "marked": None if marked is None else float(marked.numpy()),
        "iterations": int(optimizer.iterations.numpy()),
        "ddp_all_reduces": counter.all_reduces,
        "gradaccum_all_reduces": 0 if acc is None else acc.all_reduces,
        "reduce_scatters": 0 if acc is None else acc.reduce_scatters,
        "all_gathers": 0 if acc is None else acc.all_gathers,
        "shard_size": shard_sizes[0] if shard_sizes else None,
        "mid_window": mid,
        "noise_scale": acc.noise_scale if mode in ("steps", "sharded") else None,
        **{f"per_update_{k}": v for k, v in log.items()},
    }


def main(rank: int, port: str, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        results = {"world_size": dist.get_world_size(),
                   **{mode: train(mode, rank)
                      for mode in ("steps", "sharded", "budget", "overwrite",
                                   "builtin")}}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
