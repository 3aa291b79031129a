"""The two steps of a window of fixed length on JAX (issue 54): micro-batches that
cannot close their window run a step compiled without the close (no conditional,
no sums emptied), chosen on the host (`gradaccum.backends.jax.phases`); the
window's k-th runs the whole step. The updates are the large batch's.

They run where they pay (a GPU or a TPU: `phases.worth_it`); here, on a CPU, every
test but the first makes them run (`everywhere`). What the rest of the contract says
of `fit` is run with them too: test_jax_phases_contract.py."""

from __future__ import annotations

import shutil

import jax
import keras
import numpy as np
import pytest
from largebatch import (
    SCE,
    assert_optimizer_close,
    assert_weights_close,
    data,
    mlp,
    reference_fit,
    windows_of,
)

import gradaccum
from gradaccum.backends.jax import phases as phases_module


@pytest.fixture
def everywhere(monkeypatch):
    monkeypatch.setattr(phases_module, "worth_it", lambda: True)


def test_on_a_cpu_fit_runs_the_one_step():
    x, y = data(24)
    model = _accumulating()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert phases_module.worth_it() is False
    assert _phases(model) is None
    # Asked for (as benchmarks/gpu.py does), the two steps run: the next fit's.
    model._gradaccum_accumulation.phases_wanted = True
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert _phases(model).calls == {True: 2, False: 4}
    model._gradaccum_accumulation.phases_wanted = False
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert _phases(model) is None
    assert int(model.optimizer.iterations) == 6


def _accumulating(steps=3, steps_per_execution=None, **options):
    model = gradaccum.accumulate(mlp(0), steps=steps, **options)
    per_call = {} if steps_per_execution is None else {
        "steps_per_execution": steps_per_execution}
    model.compile(keras.optimizers.Adam(0.05), SCE, **per_call)
    return model


def _phases(model):
    return model._gradaccum_accumulation._phases


def _reference(x, y, lengths, epochs):
    """Plain Keras on windows of `lengths` micro-batches of 4, each epoch."""
    model = mlp(0)
    model.compile(keras.optimizers.Adam(0.05), SCE)
    return reference_fit(model, windows_of([4] * (len(x) // 4), lengths), x, y,
                         epochs=epochs)


# An epoch of 10 micro-batches of 4, windows of 3: where each epoch's windows end.
CASES = {
    # The epoch's last window (1 micro-batch) applied at its end, every epoch.
    "flush": ([3, 3, 3, 1], 8),
    # ... or dropped: its micro-batch trains nothing.
    "drop": ([3, 3, 3], 8),
    # ... or carried: the second epoch's windows start one micro-batch in.
    "carry": (None, 6),
}


@pytest.mark.parametrize("partial", list(CASES))
@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_only_the_micro_batches_that_may_close_run_the_close(partial, steps_per_execution,
                                                               everywhere):
    x, y = data(40)
    model = gradaccum.accumulate(mlp(0), steps=3, partial=partial)
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=steps_per_execution)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    windows, closes = CASES[partial]
    assert _phases(model).calls == {True: closes, False: 20 - closes}
    if windows is None:
        # carry: windows run across the epoch's end (x twice, the first epoch's
        # last micro-batch opening the second epoch's first window).
        reference = _reference(np.concatenate([x, x]), np.concatenate([y, y]), [3] * 6, 1)
        assert model._gradaccum_accumulation.open_micro_batches() == 2
    else:
        reference = _reference(x, y, windows, 2)
    assert_weights_close(model, reference)
    assert_optimizer_close(model.optimizer, reference.optimizer)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)


def _primitives(model, closes):
    """How many times each primitive of the step `closes` chose runs per
    micro-batch (inner jaxprs, such as `jnp.where`'s, counted where they are
    called), with the shapes of their results: `(name, shape) -> count`."""
    step = model._gradaccum_accumulation.step
    state = tuple(
        [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in variables]
        for variables in (model.trainable_variables, model.non_trainable_variables,
                          model.optimizer.variables, model.metrics_variables)
    )
    batch = (jax.ShapeDtypeStruct((4, 6), "float32"), jax.ShapeDtypeStruct((4,), "int32"))

    def phase(state, data):
        return step(state, data, closes=closes)

    counts: dict = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                key = (eqn.primitive.name, tuple(var.aval.shape))
                counts[key] = counts.get(key, 0) + 1
            if eqn.primitive.name == "cond":
                continue  # what a branch holds runs only when the window closes
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(phase)(state, batch).jaxpr)
    return counts


def test_the_step_without_the_close_has_no_conditional_and_empties_no_sums(everywhere):
    x, y = data(24)
    model = _accumulating()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    passing, whole = _primitives(model, False), _primitives(model, True)

    def count(counts, name, shapes=None):
        return sum(n for (p, shape), n in counts.items()
                   if p == name and (shapes is None or shape in shapes))

    # The update's conditional (lax.cond) is the whole step's; the step without
    # the close has none.
    assert count(whole, "cond") >= 1
    assert count(passing, "cond") == 0
    # The whole step has one more masked select per sum, over all of it: the
    # sums emptied where a window closed.
    shapes = {tuple(v.shape) for v in model.trainable_variables}
    assert count(whole, "select_n", shapes) - count(passing, "select_n", shapes) == len(shapes)


def test_train_on_batch_outside_fit_runs_the_whole_step(everywhere):
    # Outside an epoch the host knows nothing of the window: every call may close.
    x, y = data(24)
    model = _accumulating()
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, shuffle=False, verbose=0)
    before = dict(_phases(model).calls)
    for start in range(0, 24, 4):
        model.train_on_batch(x[start:start + 4], y[start:start + 4])
    calls = _phases(model).calls
    assert calls[True] - before[True] == 6 and calls[False] == before[False]
    # Windows of 3: the fit's 2 micro-batches (flushed: one update), then the 6 of
    # train_on_batch make 2 windows.
    assert int(model.optimizer.iterations) == 3


def test_a_count_gone_wrong_is_raised_at_the_epochs_end(monkeypatch, everywhere):
    # The host's count and the state's disagree (here: a count one ahead, as a
    # change of the state outside the step would make it): the step without the
    # close meets a due window and records it; fit raises at the epoch's end
    # instead of training on with windows of another length.
    x, y = data(40)
    model = _accumulating()
    original = phases_module.HostWindow.start

    def ahead(self, length, *args):
        original(self, length + 1, *args)

    monkeypatch.setattr(phases_module.HostWindow, "start", ahead)
    with pytest.raises(RuntimeError, match=r"counted on the host that a micro-batch "
                                           r"closed no window, and the training state's "
                                           r"window held 3 micro-batches with it"):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)


def test_load_weights_between_epochs_counts_from_the_loaded_window(tmp_path, everywhere):
    # A window of 2 micro-batches saved, loaded into a model that is mid-fit-free:
    # the next fit's count starts from the loaded window.
    x, y = data(40)
    saver = _accumulating()
    saver.fit(x[:8], y[:8], batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    # Keras's train_on_batch: one more micro-batch, the window of 3 still open.
    saver.train_on_batch(x[8:12], y[8:12])
    saver.save_weights(path)
    model = _accumulating(partial="carry")
    model.fit(x[:4], y[:4], batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.load_weights(path)
    assert model._gradaccum_accumulation.open_micro_batches() == 1
    model.fit(x[12:40], y[12:40], batch_size=4, epochs=1, shuffle=False, verbose=0)
    # 1 + 7 micro-batches: windows close at the 2nd and 5th; 2 remain open.
    assert model._gradaccum_accumulation.open_micro_batches() == 2


def _both(run):
    """`run(model)` on a model trained by the one step and on one trained by the two
    steps: the two end with the same weights, optimizer state and updates."""
    models = []
    for wanted in (False, True):
        model = _accumulating(steps_per_execution=1)  # a callback per micro-batch
        model._gradaccum_accumulation.phases_wanted = wanted
        run(model)
        models.append(model)
    one, two = models
    assert _phases(one) is None and _phases(two) is not None
    assert_weights_close(two, one)
    assert_optimizer_close(two.optimizer, one.optimizer)
    return one, two


def test_a_position_loaded_by_a_callback_of_its_own_trains_every_micro_batch(tmp_path):
    # A mid-epoch checkpoint (micro-batch 5 of 10) loaded by the user's own callback
    # as the fit begins: no BackupAndRestore restarts the epoch, so the step passes
    # over nothing, and neither does the host's count (the reviewer's case: it
    # passed over 5 and then met due windows in the step without the close).
    x, y = data(40)
    path = str(tmp_path / "mid.weights.h5")

    class SaveAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                self.model.save_weights(path)

    class ResumeFrom(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.model.load_weights(path)

    saver = _accumulating(steps_per_execution=1)
    saver.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[SaveAt()])

    def run(model):
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                  callbacks=[ResumeFrom()])

    one, two = _both(run)
    # The loaded window (2 of 3) + 20 micro-batches: windows close at 1, 4, 7, 10
    # (the epoch's end flushes), 13, 16, 19, 20; and the saved updates were 1.
    assert int(two.optimizer.iterations) == 1 + 8


def test_a_restored_position_past_the_epochs_end_passes_over_that_epoch_only(tmp_path):
    # BackupAndRestore saved micro-batch 8 of an epoch of 10; the run resumes on
    # epochs of 6: the first passes over all 6 (trained on already), the next ones
    # train all theirs (a position left over from the first skipped 2 of the
    # second before).
    x, y = data(40)
    backup = str(tmp_path / "backup")

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch == 7:
                raise KeyboardInterrupt

    crashed = _accumulating(steps_per_execution=1)
    with pytest.raises(KeyboardInterrupt):
        crashed.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup, save_freq=1, delete_checkpoint=False),
            Crash()])
    restored = int(crashed.optimizer.iterations)

    copies = iter(range(2))

    def run(model):
        # Each run resumes from the crash's backup (a copy: a run writes its own).
        copy = shutil.copytree(backup, tmp_path / f"copy{next(copies)}")
        model.fit(x[:24], y[:24], batch_size=4, epochs=3, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(str(copy), save_freq=1)])

    one, two = _both(run)
    # Epoch 1 passes over its 6, and its end flushes the window restored open (2
    # micro-batches: 8 - 6); epoch 2 trains its 6 in two windows.
    assert int(two.optimizer.iterations) == restored + 3
