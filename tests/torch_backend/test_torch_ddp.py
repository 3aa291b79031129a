"""`GradientAccumulator` under `torch.distributed` with `DistributedDataParallel`:
two gloo processes on localhost (`ddp_job.py`) train a Keras MLP (KERAS_BACKEND=
torch) wrapped in DDP, each on micro-batches of its own, unequal sizes. With
`acc.no_sync(ddp)` DDP all-reduces nothing, gradaccum makes one all-reduce per
update (one more per micro-batch with a weight budget), and both processes end with
the weights and optimizer state of one process training on the global windows
(every window's samples of both ranks concatenated, its per-sample mean loss). The
built-in way (plain DDP backward per micro-batch, `.grad` summed) all-reduces once
per micro-batch and averages the ranks' means: not the global window's mean when
their shares differ."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import torch
from largebatch import SCE, data, mlp

import gradaccum

JOB = pathlib.Path(__file__).with_name("ddp_job.py")
CONTRACT = JOB.parent.parent / "contract"
_spec = importlib.util.spec_from_file_location("ddp_job", JOB)
job_layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job_layout)
SIZES, STEPS, BUDGET = job_layout.SIZES, job_layout.STEPS, job_layout.BUDGET
EPOCHS, LEARNING_RATE = job_layout.EPOCHS, job_layout.LEARNING_RATE
MICRO_BATCHES = len(SIZES[0])

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    """Both ranks' results (one job for every mode)."""
    folder = tmp_path_factory.mktemp("ddp")
    port = str(_free_port())
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(CONTRACT), *sys.path]))
    jobs = [subprocess.Popen([sys.executable, str(JOB), str(rank), port, str(folder)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
            for rank in range(2)]
    try:
        for job in jobs:
            _, err = job.communicate(timeout=300)
            assert job.returncode == 0, err[-3000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


# The reference: one process, plain Keras on torch --------------------------------------


def _windows(lengths) -> list:
    """Per window, the rows of both ranks' micro-batches in it: each rank's
    micro-batches grouped by `lengths` (micro-batches per window, one pass)."""
    rows = [job_layout.micro_batch_rows(rank) for rank in range(2)]
    out, start = [], 0
    for length in lengths:
        out.append([rows[rank][i] for rank in range(2)
                    for i in range(start, start + length)])
        start += length
    assert start == MICRO_BATCHES
    return out * EPOCHS


def _by_budget(budget) -> list:
    """Window lengths when a window closes at the first micro-batch step after
    which the global weight (both ranks' samples) reaches `budget`; the rest of
    the pass is one partial window."""
    lengths, length, weight = [], 0, 0
    for a, b in zip(*SIZES):
        length, weight = length + 1, weight + a + b
        if weight >= budget:
            lengths.append(length)
            length, weight = 0, 0
    return lengths + ([length] if length else [])


def _by_steps() -> list:
    full, rest = divmod(MICRO_BATCHES, STEPS)
    return [STEPS] * full + ([rest] if rest else [])


def _reference(windows, exact=True):
    """One process applying one Adam update per window: the gradient of the mean
    loss over all the window's samples (`exact`), or of the mean over its
    micro-batches of their mean losses (what DDP's averaging yields when every
    rank has as many micro-batches)."""
    model = mlp(0)
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    variables = model.trainable_weights
    optimizer.build(variables)
    x, y = data(sum(map(sum, SIZES)))
    for window in windows:
        if exact:
            index = np.concatenate(window)
            xb, yb = torch.as_tensor(x[index]), torch.as_tensor(y[index])
            loss = SCE(yb, model(xb, training=True))
        else:
            loss = sum(SCE(torch.as_tensor(y[i]), model(torch.as_tensor(x[i]), training=True))
                       for i in window) / len(window)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in variables], variables)
    return model, optimizer


def _close(a, b, rtol=1e-5, atol=1e-6):
    assert len(a) == len(b)
    for p, q in zip(a, b):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=rtol, atol=atol)


def _gap(a, b) -> float:
    return max(float(np.abs(np.asarray(p) - np.asarray(q)).max()) for p, q in zip(a, b))


def _equal_ranks(ranks, mode):
    first, second = (r[mode] for r in ranks)
    _close(first["weights"], second["weights"], rtol=0, atol=0)
    _close(first["optimizer"], second["optimizer"], rtol=0, atol=0)
    return first


def _matches_reference(result, windows):
    model, optimizer = _reference(windows)
    # The run moved the weights well away from where they started.
    assert _gap(result["weights"], mlp(0).get_weights()) > 1e-2
    _close(result["weights"], model.get_weights())
    _close(result["optimizer"], [v.numpy() for v in optimizer.variables])
    assert result["iterations"] == len(windows)


# The tests ----------------------------------------------------------------------------


def test_layout_gives_ranks_unequal_shares(ranks):
    assert [r["world_size"] for r in ranks] == [2, 2]
    # Every window's shares differ, so averaging the ranks' means is not exact.
    for window in _windows(_by_steps()) + _windows(_by_budget(BUDGET)):
        half = len(window) // 2
        assert sum(map(len, window[:half])) != sum(map(len, window[half:]))


def test_no_sync_steps_trains_as_one_process_on_the_global_windows(ranks):
    lengths = _by_steps()
    assert lengths == [3, 3, 2]  # the last window of a pass is partial (`acc.apply`)
    windows = _windows(lengths)
    result = _equal_ranks(ranks, "steps")
    _matches_reference(result, windows)
    for r in ranks:
        run = r["steps"]
        assert run["updates"] == len(windows) == 6
        # DDP communicated nothing; gradaccum one all-reduce per update.
        assert run["ddp_all_reduces"] == 0
        assert run["gradaccum_all_reduces"] == run["updates"]
        assert run["per_update_ddp_all_reduces"] == [0] * 6
        assert run["per_update_gradaccum_all_reduces"] == list(range(1, 7))
        # The recorded window weight is the global window's sample count.
        assert run["per_update_window_weight"] == [
            float(sum(map(len, w))) for w in windows]


def test_the_noise_scale_counts_each_ranks_share_as_a_piece(ranks):
    # One process fed each rank's micro-batch as a piece of its own, window by
    # window: the same pieces and the same sums give the same noise scale.
    model = mlp(0)
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    variables = model.trainable_weights
    optimizer.build(variables)
    acc = gradaccum.GradientAccumulator(variables, steps=100, noise_scale=True)
    x, y = data(sum(map(sum, SIZES)))
    for window in _windows(_by_steps()):
        for index in window:
            loss = SCE(torch.as_tensor(y[index]),
                       model(torch.as_tensor(x[index]), training=True))
            model.zero_grad()
            loss.backward()
            acc.accumulate([v.value.grad for v in variables], weight=len(index))
        acc.apply(optimizer)
    expected = acc.noise_scale
    assert np.isfinite(expected)
    for r in ranks:
        for mode in ("steps", "sharded"):
            np.testing.assert_allclose(r[mode]["noise_scale"], expected, rtol=1e-4)


def test_sharded_sums_train_as_one_process_with_half_of_the_sums_each(ranks):
    # sums="sharded": each rank holds half of the MLP's sums (flattened, float32),
    # receives its half of both ranks' gradients per micro-batch (one
    # reduce-scatter) and gathers them when a window closes (one all-gather, and
    # one all-reduce of the window's weight and received counts); saved and loaded
    # in the middle of a window, it goes on as one process on the global windows.
    windows = _windows(_by_steps())
    result = _equal_ranks(ranks, "sharded")
    _matches_reference(result, windows)
    parameters = sum(int(np.prod(np.shape(w))) for w in mlp(0).get_weights())
    for r in ranks:
        run = r["sharded"]
        assert run["shard_size"] == -(-parameters // 2)
        assert run["ddp_all_reduces"] == 0
        assert run["reduce_scatters"] == EPOCHS * MICRO_BATCHES
        # (One more of each for the `gradients()` call in the middle of a window.)
        assert run["updates"] == 6
        assert run["all_gathers"] == run["gradaccum_all_reduces"] == 7
        assert run["per_update_reduce_scatters"] == [3, 6, 8, 11, 14, 16]
    # In the middle of a window, `gradients()` of sharded sums is the ranks' window:
    # the weighted mean of each rank's own window (what whole sums give each rank).
    local = [r["steps"]["mid_window"] for r in ranks]
    total = sum(window["total_weight"] for window in local)
    expected = [sum(np.asarray(window["gradients"][j]) * window["total_weight"]
                    for window in local) / total
                for j in range(len(local[0]["gradients"]))]
    for r in ranks:
        _close(r["sharded"]["mid_window"]["gradients"], expected)


def test_sharded_sums_on_one_process_and_a_value_that_is_none():
    marked = keras.Variable(0.0, name="marked")
    marked.overwrite_with_gradient = True
    # One process: nothing to shard (not even a float8 variable, refused across
    # processes, whose maximum needs whole values).
    acc = gradaccum.GradientAccumulator([marked], steps=2, sums="sharded")
    assert acc.sums == "sharded"
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator([marked], steps=2, sums="shards")
    assert str(info.value) == (
        "`sums` must be one of 'local', 'sharded'. Received: sums='shards'"
    )


def test_an_overwrite_variable_takes_the_maximum_over_the_ranks(ranks):
    # float8's rule across processes: the last window of the last pass holds
    # micro-batches 6 and 7, rank 1 handing 16 and 17: the maximum, on both ranks
    # (a sum would give 23, a mean 11.5). The other variables train as `steps`.
    windows = _windows(_by_steps())
    for r in ranks:
        run = r["overwrite"]
        assert run["marked"] == 17.0
        assert run["updates"] == 6
        # One all-reduce of the sums and one of the maxima per update.
        assert run["gradaccum_all_reduces"] == 2 * run["updates"]
    result = _equal_ranks(ranks, "overwrite")
    _close(result["weights"], _reference(windows)[0].get_weights())


def test_no_sync_weight_budget_closes_on_the_global_weight(ranks):
    lengths = _by_budget(BUDGET)
    # Global weights 8+7, 6+3+9, 15, then 6+4 left for `acc.apply`.
    assert lengths == [2, 3, 1, 2]
    windows = _windows(lengths)
    result = _equal_ranks(ranks, "budget")
    _matches_reference(result, windows)
    assert result["per_update_window_weight"] == [15.0, 18.0, 15.0, 10.0] * EPOCHS
    for r in ranks:
        run = r["budget"]
        assert run["updates"] == len(windows) == 8
        assert run["ddp_all_reduces"] == 0
        # One scalar all-reduce per micro-batch (the global window weight), one
        # per update.
        assert run["gradaccum_all_reduces"] == EPOCHS * MICRO_BATCHES + run["updates"]


def test_builtin_ddp_accumulation_all_reduces_every_micro_batch(ranks):
    windows = _windows(_by_steps())
    result = _equal_ranks(ranks, "builtin")
    assert result["iterations"] == len(windows) == 6
    for r in ranks:
        run = r["builtin"]
        assert run["gradaccum_all_reduces"] == 0
        # k all-reduces per update of k micro-batches (one bucket: a small MLP).
        assert run["ddp_all_reduces"] == EPOCHS * MICRO_BATCHES
        assert np.diff([0] + run["per_update_ddp_all_reduces"]).tolist() == [3, 3, 2] * 2
    # DDP averages the ranks' means: the mean of the micro-batches' mean losses...
    model, _ = _reference(windows, exact=False)
    _close(result["weights"], model.get_weights())
    # ...which is not the global windows' mean under unequal shares.
    assert _gap(result["weights"], ranks[0]["steps"]["weights"]) > 1e-3


@pytest.mark.parametrize("group", ["world", 2])
def test_process_group_must_be_auto_none_or_a_process_group(group):
    model = mlp(0)
    with pytest.raises(ValueError, match=(
            r'`process_group` must be "auto", None or a torch.distributed '
            rf"ProcessGroup. Received: process_group={group!r}")):
        gradaccum.GradientAccumulator(model.trainable_weights, steps=2, process_group=group)


def test_auto_without_torch_distributed_reduces_nothing():
    # This process has no process group: each window is its own.
    model = mlp(0)
    x, y = data(4)
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    acc = gradaccum.GradientAccumulator(model.trainable_weights, steps=1)
    with acc.no_sync(model):  # not a DDP module: nothing
        loss = SCE(torch.as_tensor(y), model(torch.as_tensor(x), training=True))
        model.zero_grad()
        loss.backward()
    assert bool(acc.step(optimizer, [v.value.grad for v in model.trainable_weights], 4))
    assert acc.all_reduces == 0
