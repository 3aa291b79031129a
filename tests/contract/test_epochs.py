"""Epochs under accumulation, on every backend (`SEMANTICS.md`, "Epochs"): an epoch is
the micro-batches `fit` was asked for (`steps_per_epoch`), whatever
`steps_per_execution` gradaccum chose, taken in the data's order and cut into
windows. Each case against plain Keras on the same micro-batches as large batches,
and the data source asked for as many batches as plain Keras asks at
`steps_per_execution=1`."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from largebatch import SCE, assert_optimizer_close, assert_weights_close, max_gap, mlp
from test_logs import TrackedStep

import gradaccum

B = 4  # samples per micro-batch
PERIOD = 40  # micro-batches in the stream before it repeats
rng = np.random.default_rng(7)
X = rng.normal(size=(B * PERIOD, 6)).astype("float32")
Y = rng.integers(0, 3, size=(B * PERIOD,)).astype("int32")


def micro_batch(i):
    i %= PERIOD
    return X[B * i:B * (i + 1)], Y[B * i:B * (i + 1)]


class Counted:
    """An endless generator of the stream's micro-batches that counts the ones
    asked for."""

    def __init__(self, period=PERIOD, start=0):
        self.asked = 0
        self.period = period
        self.start = start

    def __iter__(self):
        while True:
            batch = micro_batch((self.start + self.asked) % self.period)
            self.asked += 1
            yield batch


class Sequence(keras.utils.PyDataset):
    """The stream as a PyDataset of `length` micro-batches, counting the reads."""

    def __init__(self, length=PERIOD, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.asked = 0

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        self.asked += 1
        return micro_batch(index)


def tf_data(kind):
    tf = pytest.importorskip("tensorflow")
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(B)
    if kind == "unknown length":
        # Keras cannot know this one's length: a filter keeps every batch.
        dataset = dataset.filter(lambda x, y: tf.shape(x)[0] > 0)
    return dataset.repeat()


def windows(k, n, epochs, partial, start=0):
    """The micro-batch indices of each update plain Keras makes on the windows:
    `epochs` epochs of `n` micro-batches from `start` on, windows of `k`, the rest
    of an epoch flushed, dropped or carried."""
    updates, open_window = [], []
    for epoch in range(epochs):
        for i in range(start + epoch * n, start + (epoch + 1) * n):
            open_window.append(i)
            if len(open_window) == k:
                updates.append(open_window)
                open_window = []
        if open_window and partial != "carry":
            if partial == "flush":
                updates.append(open_window)
            open_window = []
    return updates


def reference(updates, optimizer, model=None):
    model = model or mlp(0)
    model.compile(optimizer, SCE)
    for update in updates:
        parts = [micro_batch(i) for i in update]
        model.train_on_batch(np.concatenate([p[0] for p in parts]),
                             np.concatenate([p[1] for p in parts]))
    return model


def assert_asked_as_plain_keras(source, n, epochs):
    """`source` was asked for as many batches as plain Keras (one batch per call)
    asks a new one for. On TensorFlow a generator or PyDataset is read through
    tf.data's autotuned prefetch, which asks ahead as its threads find time: there
    the weights and `iterations` say which batches were trained on, and the source
    was asked for those at least."""
    model = mlp(0)
    model.compile(keras.optimizers.SGD(0.1), SCE)
    plain = type(source)()
    model.fit(_fit_data(plain), epochs=epochs, steps_per_epoch=n, shuffle=False, verbose=0)
    if keras.backend.backend() == "tensorflow":
        assert source.asked >= n * epochs
    else:
        assert source.asked == plain.asked >= n * epochs


def assert_asked(source, count, used):
    """`source` was asked for `count` batches (`used` at least through TensorFlow's
    prefetch: see `assert_asked_as_plain_keras`)."""
    if keras.backend.backend() == "tensorflow":
        assert source.asked >= used
    else:
        assert source.asked == count >= used


def _fit_data(source):
    return iter(source) if isinstance(source, Counted) else source


def per_call(count):
    """`steps_per_execution=count` where the backend runs several batches per call
    (Keras's PyTorch backend runs one)."""
    return 1 if keras.backend.backend() == "torch" else count


def _accumulating(k, optimizer, model=None, **options):
    model = gradaccum.accumulate(model or mlp(0), steps=k, **options)
    model.compile(optimizer, SCE)
    return model


@pytest.mark.parametrize("k, n", [(3, 4), (4, 6), (5, 7), (3, 3), (3, 2), (2, 6)])
def test_steps_per_epoch_trains_exactly_n_micro_batches(k, n):
    # The table: at 44e53bb TensorFlow and JAX trained whole calls of k.
    source = Counted()
    model = _accumulating(k, keras.optimizers.SGD(0.5))
    history = model.fit(iter(source), epochs=2, steps_per_epoch=n, shuffle=False, verbose=0)
    updates = windows(k, n, 2, "flush")
    expected = reference(updates, keras.optimizers.SGD(0.5))
    assert max_gap(model, mlp(0)) > 1e-3
    assert_weights_close(model, expected)
    assert int(model.optimizer.iterations) == len(updates)
    per_epoch = len(windows(k, n, 1, "flush"))
    assert history.history["updates"] == [float(per_epoch), float(2 * per_epoch)]
    assert_asked_as_plain_keras(source, n, 2)


@pytest.mark.parametrize("partial", ["flush", "carry", "drop"])
def test_each_partial_policy_closes_the_epochs_rest_as_it_says(partial):
    source = Counted()
    model = _accumulating(3, keras.optimizers.Adam(0.05), partial=partial)
    history = model.fit(iter(source), epochs=3, steps_per_epoch=5, shuffle=False, verbose=0)
    updates = windows(3, 5, 3, partial)
    expected = reference(updates, keras.optimizers.Adam(0.05))
    assert_weights_close(model, expected)
    assert_optimizer_close(model.optimizer, expected.optimizer)
    assert history.history["updates"][-1] == float(len(updates))
    assert_asked_as_plain_keras(source, 5, 3)
    # carry: 15 micro-batches are 5 windows; flush: 2 per epoch; drop: 1 per epoch.
    assert len(updates) == {"flush": 6, "carry": 5, "drop": 3}[partial]


SOURCES = {
    "arrays": lambda: (X, Y),
    "generator": lambda: iter(Counted()),
    "pydataset": lambda: Sequence(),
    "pydataset, 2 workers": lambda: Sequence(workers=2),
    "tf.data repeated": lambda: tf_data("repeated"),
    "tf.data of unknown length": lambda: tf_data("unknown length"),
}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_data_source_gives_the_same_micro_batches(name):
    data = SOURCES[name]()
    model = _accumulating(3, keras.optimizers.SGD(0.5))
    if name == "arrays":
        model.fit(*data, batch_size=B, shuffle=False, epochs=2, steps_per_epoch=4, verbose=0)
    else:
        model.fit(data, epochs=2, steps_per_epoch=4, shuffle=False, verbose=0)
    if name == "pydataset, 2 workers":
        # Keras's workers restart the epoch's reads in an order of their own: the
        # reference is Keras's one batch per call, accumulated.
        expected = gradaccum.accumulate(mlp(0), steps=3)
        expected.compile(keras.optimizers.SGD(0.5), SCE, steps_per_execution=1)
        expected.fit(SOURCES[name](), epochs=2, steps_per_epoch=4, shuffle=False, verbose=0)
    else:
        expected = reference(windows(3, 4, 2, "flush"), keras.optimizers.SGD(0.5))
    assert max_gap(model, mlp(0)) > 1e-3
    assert_weights_close(model, expected)
    assert int(model.optimizer.iterations) == 4
    if name == "pydataset":
        assert_asked_as_plain_keras(data, 4, 2)


def test_data_that_runs_out_before_the_epoch_ends_as_plain_keras_does():
    # A PyDataset of 7 micro-batches, steps_per_epoch=9: Keras warns and stops after
    # the 7 (at one batch per call); the window the data ends in is flushed.
    model = _accumulating(3, keras.optimizers.SGD(0.5))
    with pytest.warns(UserWarning, match="ran out of data"):
        model.fit(Sequence(length=7), epochs=1, steps_per_epoch=9, shuffle=False, verbose=0)
    expected = reference(windows(3, 7, 1, "flush"), keras.optimizers.SGD(0.5))
    assert_weights_close(model, expected)
    assert int(model.optimizer.iterations) == 3


def test_data_of_unknown_length_that_runs_out_inside_a_call():
    # 7 micro-batches Keras cannot count (a filtered dataset), steps_per_epoch=9, 3 a
    # call: the data ends inside the third call. Each epoch trains the 7 (windows
    # 3, 3, 1), as at one batch per call; a whole call of Keras's own would stop
    # without a word and leave the next epoch a spent iterator.
    tf = pytest.importorskip("tensorflow")

    def data():
        dataset = tf.data.Dataset.from_tensor_slices((X[:B * 7], Y[:B * 7])).batch(B)
        return dataset.filter(lambda x, y: tf.shape(x)[0] > 0)

    model = _accumulating(3, keras.optimizers.SGD(0.5))
    with pytest.warns(UserWarning, match="ran out of data"):
        history = model.fit(data(), epochs=2, steps_per_epoch=9, verbose=0)
    expected = reference(windows(3, 7, 1, "flush") * 2, keras.optimizers.SGD(0.5))
    assert_weights_close(model, expected)
    assert history.history["updates"] == [3.0, 6.0]


def test_a_users_steps_per_execution_that_is_not_a_multiple_of_the_window():
    source = Counted()
    model = gradaccum.accumulate(mlp(0), steps=3)
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=per_call(2))
    model.fit(iter(source), epochs=2, steps_per_epoch=7, shuffle=False, verbose=0)
    expected = reference(windows(3, 7, 2, "flush"), keras.optimizers.Adam(0.05))
    assert_weights_close(model, expected)
    assert_optimizer_close(model.optimizer, expected.optimizer)
    assert_asked_as_plain_keras(source, 7, 2)


def test_a_models_own_train_step():
    model = TrackedStep()
    model(np.zeros((1, 6), "float32"))
    model.set_weights(mlp(0).get_weights())
    model = _accumulating(3, keras.optimizers.Adam(0.05), model=model)
    source = Counted()
    model.fit(iter(source), epochs=2, steps_per_epoch=5, shuffle=False, verbose=0)
    expected = reference(windows(3, 5, 2, "flush"), keras.optimizers.Adam(0.05))
    assert_weights_close(model, expected)
    assert int(model.optimizer.iterations) == 4
    assert_asked_as_plain_keras(source, 5, 2)


@pytest.mark.parametrize("size", [2, "auto"])
def test_split_mode_an_epoch_is_n_batches_each_one_update(size):
    # Batches of 4 split into micro-batches of 2 (or as "auto" finds), three batches
    # per call given by the user: 5 batches per epoch are 5 updates.
    model = gradaccum.accumulate(mlp(0), micro_batch_size=size)
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=per_call(3))
    source = Counted()
    history = model.fit(iter(source), epochs=2, steps_per_epoch=5, shuffle=False, verbose=0)
    expected = reference([[i] for i in range(10)], keras.optimizers.Adam(0.05))
    assert_weights_close(model, expected)
    assert history.history["updates"] == [5.0, 10.0]
    assert_asked_as_plain_keras(source, 5, 2)


def test_validation_sees_the_epochs_last_update_on_the_batches_asked_for():
    # validation_steps=2 at 3 batches per call, every second epoch: each validation
    # reads the validation data's first 2 batches and sees the flushed window.
    validation = Sequence()
    model = _accumulating(3, keras.optimizers.SGD(0.5))
    history = model.fit(iter(Counted()), epochs=4, steps_per_epoch=4, shuffle=False,
                        validation_data=validation, validation_steps=2,
                        validation_freq=2, verbose=0)
    x = np.concatenate([micro_batch(i)[0] for i in (0, 1)])
    y = np.concatenate([micro_batch(i)[1] for i in (0, 1)])
    losses = []
    for epochs in (2, 4):
        expected = reference(windows(3, 4, epochs, "flush"), keras.optimizers.SGD(0.5))
        losses.append(float(SCE(y, expected(x))))
    np.testing.assert_allclose(history.history["val_loss"], losses, rtol=1e-5)
    plain, plain_validation = mlp(0), Sequence()
    plain.compile(keras.optimizers.SGD(0.5), SCE)
    plain.fit(iter(Counted()), epochs=4, steps_per_epoch=4, validation_data=plain_validation,
              validation_steps=2, validation_freq=2, verbose=0)
    assert_asked(validation, plain_validation.asked, 4)


def test_evaluate_steps_count_batches_whatever_steps_per_execution():
    model = _accumulating(3, keras.optimizers.SGD(0.5))
    source = Sequence()
    loss = model.evaluate(source, steps=4, verbose=0)
    x = np.concatenate([micro_batch(i)[0] for i in range(4)])
    y = np.concatenate([micro_batch(i)[1] for i in range(4)])
    assert loss == pytest.approx(float(SCE(y, mlp(0)(x))), rel=1e-5)
    plain, plain_source = mlp(0), Sequence()
    plain.compile(keras.optimizers.SGD(0.5), SCE)
    plain.evaluate(plain_source, steps=4, verbose=0)
    assert_asked(source, plain_source.asked, 4)


def test_predict_steps_that_would_round_up_to_whole_calls_are_refused():
    # Keras predicts whole calls of steps_per_execution batches: 4 at 3 a call would
    # give 6 batches' predictions. A multiple, or the user's own steps_per_execution,
    # is as plain Keras.
    model = _accumulating(3, keras.optimizers.SGD(0.5))
    if keras.backend.backend() == "torch":
        assert model.predict(X, batch_size=B, steps=4, verbose=0).shape == (16, 3)
        return
    with pytest.raises(ValueError, match=r"Received: steps=4\. Pass a multiple of 3"):
        model.predict(X, batch_size=B, steps=4, verbose=0)
    predicted = model.predict(X, batch_size=B, steps=6, verbose=0)
    np.testing.assert_allclose(predicted, mlp(0).predict(X[:24], verbose=0), rtol=1e-5,
                               atol=1e-6)
    model.compile(keras.optimizers.SGD(0.5), SCE, steps_per_execution=3)
    assert model.predict(X, batch_size=B, steps=4, verbose=0).shape == (24, 3)


def test_fit_twice_goes_on_where_the_first_ended_with_a_carried_window():
    model = _accumulating(3, keras.optimizers.Adam(0.05), partial="carry")
    model.fit(iter(Counted()), epochs=1, steps_per_epoch=4, shuffle=False, verbose=0)
    assert model._gradaccum_accumulation.open_micro_batches() == 1
    # The user's data goes on from the 5th micro-batch.
    model.fit(iter(Counted(start=4)), epochs=2, initial_epoch=1, steps_per_epoch=4,
              shuffle=False, verbose=0)
    expected = reference(windows(3, 4, 2, "carry"), keras.optimizers.Adam(0.05))
    assert_weights_close(model, expected)
    assert int(model.optimizer.iterations) == 2
    assert model._gradaccum_accumulation.open_micro_batches() == 2


def test_backup_and_restore_inside_an_epoch_given_by_steps_per_epoch(tmp_path):
    # Each epoch is the same 5 micro-batches (a stream of period 5); killed in the
    # second epoch after its backup at the 4th micro-batch, resumed by a new fit.
    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch >= 4:
                raise RuntimeError("interrupted")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    backup = str(tmp_path / "backup")
    model = _accumulating(3, keras.optimizers.Adam(0.05))
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=per_call(2))
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(iter(Counted(period=5)), epochs=3, steps_per_epoch=5, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=2),
                             Interrupt()])
    resumed = _accumulating(3, keras.optimizers.Adam(0.05), model=mlp(9))
    resumed.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=per_call(2))
    resumed.fit(iter(Counted(period=5)), epochs=3, steps_per_epoch=5, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=2)])
    uninterrupted = _accumulating(3, keras.optimizers.Adam(0.05))
    uninterrupted.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=per_call(2))
    uninterrupted.fit(iter(Counted(period=5)), epochs=3, steps_per_epoch=5, shuffle=False,
                      verbose=0)
    assert_weights_close(resumed, uninterrupted)
    assert_optimizer_close(resumed.optimizer, uninterrupted.optimizer)
    assert int(resumed.optimizer.iterations) == 6
