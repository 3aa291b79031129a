"""A training process SIGKILLed at many moments inside a save of its weights and
window state (issue 43, item 3), on every backend (this module runs in the
TensorFlow and in the JAX process): each resumed run loads the previous checkpoint
or the new one and ends with the weights of the uninterrupted run, or stops with
the clear error of a state that does not belong to its weights. Never a silent
loss. Each kill point is a process of its own (`kill_job.py`), forked from a
server that imported Keras and gradaccum once (multiprocessing's forkserver), with
JAX's compilation cache shared: about half a second a point."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import shutil
import sys

import keras
import numpy as np
import pytest
from largebatch import assert_optimizer_close, assert_weights_close, data

from gradaccum.attach import accumulation_of

JOB = pathlib.Path(__file__).with_name("kill_job.py")
sys.path.insert(0, str(JOB.parent))
from kill_job import FIRST, SECOND, trainer  # noqa: E402

# Moments of the second save, as fractions of its duration (about 20 ms here): 18
# points spread over it and a little past it (the weights' write, the state's, the
# renames: the save's own length varies), and two after it.
FRACTIONS = [round(0.08 * i, 2) for i in range(18)] + [2.0, 3.0]


def _kill_job(directory, fraction):
    import kill_job

    kill_job.main(directory, fraction)


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    """A forkserver whose server imported the job's modules."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if keras.backend.backend() == "jax":
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax"))
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["keras", "gradaccum", "largebatch", "kill_job"])
    return context


def _run(context, directory, fraction) -> None:
    process = context.Process(target=_kill_job, args=(str(directory), fraction))
    process.start()
    process.join(300)
    assert process.exitcode == -9, process.exitcode


@pytest.fixture(scope="module")
def runs():
    """The uninterrupted run: weights, optimizer variables and open micro-batches
    at each checkpoint, and the model at the end."""
    x, y = data(48)
    model = trainer()
    checkpoints = {}
    for name, (start, stop) in (("previous", (0, FIRST)), ("new", (FIRST, SECOND))):
        model.fit(x[start:stop], y[start:stop], batch_size=4, shuffle=False, verbose=0)
        checkpoints[name] = _snapshot(model)
    model.fit(x[SECOND:], y[SECOND:], batch_size=4, shuffle=False, verbose=0)
    return {"checkpoints": checkpoints, "end": model}


def _snapshot(model):
    return ([w.copy() for w in model.get_weights()],
            [np.array(keras.ops.convert_to_numpy(v)) for v in model.optimizer.variables],
            accumulation_of(model).open_micro_batches())


def _same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(p, q) for p, q in zip(a, b))


def test_a_kill_anywhere_in_a_save_loses_nothing_silently(tmp_path, runs, context):
    x, y = data(48)
    checkpoints = runs["checkpoints"]
    outcomes = {"previous": 0, "new": 0, "clear error": 0}
    for i, fraction in enumerate(FRACTIONS):
        directory = tmp_path / f"kill_{i}"
        directory.mkdir()
        _run(context, directory, fraction)
        path = str(directory / "ckpt.weights.h5")
        resumed = trainer(seed=7)
        resumed.build((None, 6))
        resumed.optimizer.build(resumed.trainable_variables)
        try:
            resumed.load_weights(path)
        except ValueError as error:
            assert "delete it to load the weights with an empty window" in str(error)
            outcomes["clear error"] += 1
            continue
        weights, optimizer, open_micro_batches = _snapshot(resumed)
        found = [name for name, saved in checkpoints.items() if _same(weights, saved[0])]
        assert found, f"kill point {fraction}: weights of neither checkpoint"
        name = found[0]
        # The window and the optimizer saved with those weights, not the other's.
        assert _same(optimizer, checkpoints[name][1]), fraction
        assert open_micro_batches == checkpoints[name][2], fraction
        if not outcomes[name]:
            # Resumed from each checkpoint once: it ends as the uninterrupted run.
            start = FIRST if name == "previous" else SECOND
            resumed.fit(x[start:], y[start:], batch_size=4, shuffle=False, verbose=0)
            assert_weights_close(resumed, runs["end"], rtol=1e-6, atol=1e-7)
            assert_optimizer_close(resumed.optimizer, runs["end"].optimizer, rtol=1e-6,
                                   atol=1e-7)
        outcomes[name] += 1
        # A kill before the renames leaves temporary files (never read); the next
        # save removes them.
        leftovers = [n for n in os.listdir(directory) if "gradaccum-tmp-" in n]
        assert len(leftovers) <= 2, leftovers
        resumed.save_weights(path)
        assert sorted(os.listdir(directory)) == [
            "ckpt.weights.h5", "ckpt.weights.h5.gradaccum.npz", "scratch"], fraction
        shutil.rmtree(directory)
    print(f"\n{keras.backend.backend()} kill points: {len(FRACTIONS)}, {outcomes}")
    assert sum(outcomes.values()) == len(FRACTIONS)
    # The points landed on both sides of the save's commit.
    assert outcomes["previous"] > 0 and outcomes["new"] > 0
