"""One of two JAX processes on localhost (`jax.distributed` through
`keras.distribution.initialize`, gloo collectives on CPU) training under Keras's
`DataParallel` across both, for tests/jax_backend/test_jax_processes.py. Run as
`python processes_job.py PROCESS_ID PORT`: each process feeds its half of every
global batch of 8 (its own 4 samples); prints the weights it ends with, as JSON,
for `accumulate(steps=3)` and for `Privacy` (with and without a seed)."""

from __future__ import annotations

import json
import os
import sys
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


def main(process: int, port: str) -> None:
    keras.distribution.initialize(job_addresses=f"localhost:{port}", num_processes=2,
                                  process_id=process)
    devices = keras.distribution.list_devices()
    # Each process feeds its own part of the global batch.
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False))
    privacy = dict(l2_norm_clip=1.0, noise_multiplier=0.5)
    results = {
        "devices": len(devices),
        "processes": jax.process_count(),
        "steps": trained(dict(steps=3), process),
        "private_seeded": trained(
            dict(steps=3, privacy=gradaccum.Privacy(**privacy, seed=3)), process),
        "private": trained(dict(steps=3, privacy=gradaccum.Privacy(**privacy)), process),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
