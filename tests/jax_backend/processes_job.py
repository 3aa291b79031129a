"""One of two JAX processes on localhost (`jax.distributed` through
`keras.distribution.initialize`, gloo collectives on CPU), each with 4 virtual CPU
devices (XLA_FLAGS from the test), training under Keras's `DataParallel` across the
8, for tests/jax_backend/test_jax_processes.py. Run as
`python processes_job.py PROCESS_ID PORT MODE FOLDER`: each process feeds its half
of every global batch of 8 (its own 4 samples, one per device) and prints, as JSON
lines, the weights it ends with. MODE `train`: `accumulate(steps=3)` with each
device's own sums (`sums="local"`) and 1/8 of them (`sums="sharded"`), and `Privacy`
(with and without a seed); then 5 global batches of an epoch with windows of 3
carried (two open), saved to FOLDER in both modes, and the job is killed: process 1
(SIGKILL), then process 0. MODE `resume`: new processes load those checkpoints and
train the rest."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings

warnings.simplefilter("ignore")
os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from largebatch import SCE, data, mlp  # noqa: E402

import gradaccum  # noqa: E402

GLOBAL_BATCH, SAMPLES = 8, 48


def local_rows(process: int) -> np.ndarray:
    """This process's rows of each global batch (the first half for process 0)."""
    half = GLOBAL_BATCH // 2
    return np.concatenate([np.arange(s + half * process, s + half * (process + 1))
                           for s in range(0, SAMPLES, GLOBAL_BATCH)])


def trained(options, process):
    x, y = data(SAMPLES)
    rows = local_rows(process)
    model = gradaccum.accumulate(mlp(0), **options)
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
    history = model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // 2, epochs=2,
                        shuffle=False, verbose=0)
    return {"weights": [np.asarray(w).tolist() for w in model.get_weights()],
            "updates": history.history["updates"]}


def sharded_held() -> dict:
    """What this process's first device holds of `sums="sharded"`'s sums, in floats,
    against the model's parameters."""
    model = gradaccum.accumulate(mlp(0), steps=3, sums="sharded")
    model.compile(keras.optimizers.Adam(0.05), SCE)
    from gradaccum.attach import accumulation_of

    accumulation = accumulation_of(model)
    accumulation.ensure_state()
    device = jax.local_devices()[0]
    held = sum(int(np.prod(shard.data.shape))
               for acc in accumulation.state.accumulators
               for shard in acc.value.addressable_shards if shard.device == device)
    return {"held": held, "parameters": int(sum(np.prod(v.shape)
                                                for v in model.trainable_variables))}


def checkpointed(process, folder, resume, sums="local", kill=True):
    """`stop`: the first 5 global batches, saved mid-window (then killed, unless not
    `kill`); `resume`: the rest, from that save."""
    x, y = data(SAMPLES)
    rows = local_rows(process)
    model = gradaccum.accumulate(mlp(0 if not resume else 9), steps=3, partial="carry",
                                 sums=sums)
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
    path = os.path.join(folder, f"process{process}_{sums}.weights.h5")
    cut = 5 * GLOBAL_BATCH // 2
    if resume:
        model.build((None, 6))
        model.optimizer.build(model.trainable_variables)
        model.load_weights(path)
        model.fit(x[rows][cut:], y[rows][cut:], batch_size=GLOBAL_BATCH // 2,
                  shuffle=False, verbose=0)
    else:
        model.fit(x[rows][:cut], y[rows][:cut], batch_size=GLOBAL_BATCH // 2,
                  shuffle=False, verbose=0)
        model.save_weights(path)
        if not kill:
            return {"iterations": int(model.optimizer.iterations)}
        # Killed in the middle of the window, the checkpoint on disk: process 1
        # first, then process 0, as a scheduler tears down a job one of whose
        # processes died (JAX's coordination service would abort it after a
        # heartbeat timeout).
        print(json.dumps({"iterations": int(model.optimizer.iterations)}), flush=True)
        if process == 0:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    return {"weights": [np.asarray(w).tolist() for w in model.get_weights()],
            "iterations": int(model.optimizer.iterations)}


def main(process: int, port: str, mode: str = "train", folder: str = "") -> None:
    keras.distribution.initialize(job_addresses=f"localhost:{port}", num_processes=2,
                                  process_id=process)
    devices = keras.distribution.list_devices()
    # Each process feeds its own part of the global batch.
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False))
    if mode == "resume":
        print(json.dumps({sums: checkpointed(process, folder, resume=True, sums=sums)
                          for sums in ("local", "sharded")}))
        return
    privacy = dict(l2_norm_clip=1.0, noise_multiplier=0.5)
    results = {
        "devices": len(devices),
        "processes": jax.process_count(),
        "steps": trained(dict(steps=3), process),
        "sharded": trained(dict(steps=3, sums="sharded"), process),
        "sharded_held": sharded_held(),
        "private_seeded": trained(
            dict(steps=3, privacy=gradaccum.Privacy(**privacy, seed=3)), process),
        "private": trained(dict(steps=3, privacy=gradaccum.Privacy(**privacy)), process),
    }
    print(json.dumps(results), flush=True)
    # Then the job stops in the middle of a window, killed after a save (the
    # sharded sums saved first).
    checkpointed(process, folder, resume=False, sums="sharded", kill=False)
    checkpointed(process, folder, resume=False)


if __name__ == "__main__":
    main(int(sys.argv[1]), *sys.argv[2:])
