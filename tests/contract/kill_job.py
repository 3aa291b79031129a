"""A training process killed (SIGKILL, by a thread of its own) at a given moment of
a save, for tests/contract/test_kill_during_save.py. Run as
`python kill_job.py DIRECTORY FRACTION` with KERAS_BACKEND set: it trains 16
samples in micro-batches of 4 with windows of 3 carried (one update, one
micro-batch open), saves (the previous checkpoint), trains 16 more (two open), then
saves again, killed at FRACTION of that save's duration (timed on saves to a
scratch folder first; a fraction above 1 lands after the save). Prints `saved` if
the second save returned."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings

warnings.simplefilter("ignore")

import keras  # noqa: E402
from largebatch import SCE, data, mlp  # noqa: E402

import gradaccum  # noqa: E402

FIRST, SECOND = 16, 32


def trainer(seed=0):
    model = gradaccum.accumulate(mlp(seed), steps=3, partial="carry")
    # Eager on TensorFlow: a kill point is a process of its own, and tracing would
    # cost more than the training (on JAX eager costs more than compiling).
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1,
                  run_eagerly=keras.backend.backend() == "tensorflow")
    return model


def main(directory: str, fraction: float) -> None:
    x, y = data(48)
    model = trainer()
    model.fit(x[:FIRST], y[:FIRST], batch_size=4, shuffle=False, verbose=0)
    path = os.path.join(directory, "ckpt.weights.h5")
    model.save_weights(path)
    model.fit(x[FIRST:SECOND], y[FIRST:SECOND], batch_size=4, shuffle=False, verbose=0)
    scratch = os.path.join(directory, "scratch")
    os.makedirs(scratch, exist_ok=True)
    # A save beside an earlier pair (read for the previous entry), as the one
    # killed: the last of three.
    for _ in range(3):
        start = time.perf_counter()
        model.save_weights(os.path.join(scratch, "ckpt.weights.h5"))
        duration = time.perf_counter() - start
    delay = fraction * duration

    def kill():
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    model.save_weights(path)
    print("saved", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
