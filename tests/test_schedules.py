"""Windows of varying length: a `steps` schedule by update index (a batch-size ramp)
and a weight budget (`weight_per_update`: about N tokens per update), against plain
training on the same windows."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from helpers import (
    OPTIMIZERS,
    assert_same_state,
    fit_state,
    grads_of,
    make_data,
    make_mlp,
    make_trainer,
    trained,
)

RAMP = [(0, 1), (2, 2), (4, 4)]
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def ramp_length(update):
    """The ramp written as a callable of TensorFlow ops."""
    return tf.where(update < 2, 1, tf.where(update < 4, 2, 4))


def schedule_windows(micro_batches, length, epochs=1, partial="flush"):
    """The windows (lists of micro-batch indices) a schedule makes: `length(u)`
    micro-batches for update u, the partial policy at each epoch's end."""
    windows, open_window = [], []
    for _ in range(epochs):
        for i in range(micro_batches):
            open_window.append(i)
            if len(open_window) == length(len(windows)):
                windows.append(open_window)
                open_window = []
        if open_window and partial == "flush":
            windows.append(open_window)
            open_window = []
        elif partial == "drop":
            open_window = []
    return windows


def pairs_length(pairs):
    return lambda u: [k for start, k in pairs if start <= u][-1]


def reference_on_rows(x, y, windows_rows, optimizer):
    """Plain Keras: one step per window on its samples (an index or a slice)."""
    model = make_mlp()
    for rows in windows_rows:
        optimizer.apply_gradients(
            zip(grads_of(model, x[rows], y[rows]), model.trainable_variables)
        )
    return model


def reference_on_windows(windows, x, y, batch, optimizer):
    """Plain Keras: one step per window of micro-batches of `batch` samples."""
    return reference_on_rows(
        x, y,
        [np.concatenate([np.arange(i * batch, (i + 1) * batch) for i in w]) for w in windows],
        optimizer,
    )


def uneven_batches(sizes, seed=1):
    x, y = make_data(sum(sizes), seed=seed)
    starts = np.cumsum([0, *sizes])

    def gen():
        for start, stop in zip(starts[:-1], starts[1:]):
            yield x[start:stop], y[start:stop]

    spec = (tf.TensorSpec((None, 5), tf.float32), tf.TensorSpec((None,), tf.int32))
    dataset = tf.data.Dataset.from_generator(gen, output_signature=spec)
    # A known length: fit makes no extra call to find the end of the data.
    return x, y, starts, dataset.apply(tf.data.experimental.assert_cardinality(len(sizes)))




class BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))


# A schedule of steps ----------------------------------------------------------------


def test_the_ramp_helper_makes_the_issue_windows():
    windows = schedule_windows(14, pairs_length(RAMP))
    assert [w[-1] + 1 for w in windows] == [1, 2, 4, 6, 10, 14]


@pytest.mark.parametrize("schedule", [RAMP, ramp_length], ids=["pairs", "callable"])
@pytest.mark.parametrize("eager", [False, True], ids=["function", "eager"])
@pytest.mark.parametrize("opt", ["adam", "sgd_nesterov"])
def test_ramp_updates_after_micro_batches_1_2_4_6_10_14(schedule, eager, opt):
    x, y = make_data(14 * 4)
    reference_opt = OPTIMIZERS[opt]()
    reference = reference_on_windows(
        schedule_windows(14, pairs_length(RAMP)), x, y, 4, reference_opt
    )

    model, optimizer = make_mlp(), OPTIMIZERS[opt]()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=schedule)

    def micro_batch(xb, yb):
        return acc.step(optimizer, grads_of(model, xb, yb), weight=tf.shape(xb)[0])

    step = micro_batch if eager else tf.function(micro_batch)
    applied = [bool(step(x[4 * i:4 * i + 4], y[4 * i:4 * i + 4])) for i in range(14)]
    assert [i + 1 for i, a in enumerate(applied) if a] == [1, 2, 4, 6, 10, 14]
    assert int(optimizer.iterations) == 6
    assert int(acc.updates) == 6 and int(acc.micro_step) == 0
    assert int(acc.last_window_micro_batches) == 4 and float(acc.last_window_weight) == 16
    assert_same_state(model, optimizer, reference, reference_opt, rtol=1e-5, atol=1e-6)


def test_a_schedule_continues_across_epochs_and_partial_windows(door):
    # 7 micro-batches per epoch: 1, 1, 2, 2, then a partial 1 of 4 (flushed: update 4),
    # then epoch 2: 4 and a partial 3.
    x, y = make_data(28)
    windows = schedule_windows(7, pairs_length(RAMP), epochs=2)
    assert [len(w) for w in windows] == [1, 1, 2, 2, 1, 4, 3]
    reference_opt = OPTIMIZERS["adam"]()
    reference = reference_on_windows(windows, x, y, 4, reference_opt)

    model = make_mlp()
    trainer = make_trainer(door, model, steps=RAMP)
    trainer.compile(OPTIMIZERS["adam"](), SCE)
    logs = BatchLogs()
    history = trainer.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                          callbacks=[logs])
    # A schedule compiles one micro-batch per call: batch callbacks see each one.
    assert len(logs.logs) == 14
    # The last micro-batch of the epoch flushes the partial window in its step.
    assert [int(entry["updates"]) for entry in logs.logs[:7]] == [1, 2, 2, 3, 3, 4, 5]
    assert history.history["updates"] == [5.0, 7.0]
    assert history.history["window_micro_batches"] == [1.0, 3.0]
    assert history.history["window_weight"] == [4.0, 12.0]
    accumulator = fit_state(trainer).accumulator
    assert int(accumulator.updates) == 7
    assert_same_state(trained(door, trainer), trainer.optimizer, reference, reference_opt)


def test_dropped_windows_do_not_advance_the_schedule(door):
    x, y = make_data(28)
    windows = schedule_windows(7, pairs_length(RAMP), epochs=2, partial="drop")
    # Epoch 1: 1, 1, 2, 2 and a dropped 1; epoch 2 starts update 4: k 4, then 3 dropped.
    assert [len(w) for w in windows] == [1, 1, 2, 2, 4]
    reference_opt = OPTIMIZERS["adam"]()
    reference = reference_on_windows(windows, x, y, 4, reference_opt)

    model = make_mlp()
    trainer = make_trainer(door, model, steps=RAMP, partial="drop")
    trainer.compile(OPTIMIZERS["adam"](), SCE)
    history = trainer.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert history.history["updates"] == [4.0, 5.0]
    assert_same_state(trained(door, trainer), trainer.optimizer, reference, reference_opt)


@pytest.mark.parametrize("eager", [False, True], ids=["function", "eager"])
def test_the_window_length_is_read_when_the_window_opens(eager):
    # A schedule read once per window: a callable that counts its calls runs once at
    # construction (update 0) and once per window, not per micro-batch.
    calls = tf.Variable(0, dtype=tf.int64)
    indices = tf.Variable(0, dtype=tf.int64)

    def schedule(update):
        calls.assign_add(1)
        indices.assign_add(update)
        return 3

    model, optimizer = make_mlp(), OPTIMIZERS["sgd"]()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=schedule)
    assert not bool(acc.window_due())  # an empty window is never due
    x, y = make_data(9 * 2)

    def micro_batch(xb, yb):
        return acc.step(optimizer, grads_of(model, xb, yb))

    step = micro_batch if eager else tf.function(micro_batch)
    for i in range(9):
        step(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])
    assert int(calls) == 4 and int(indices) == 0 + 0 + 1 + 2
    assert int(acc.state.window_steps) == 3 and int(optimizer.iterations) == 3
    assert not bool(acc.window_due())


def python_ramp(update):
    """The ramp with Python control flow on the index (AutoGraph makes it a graph's)."""
    if update < 2:
        k = 1
    elif update < 4:
        k = 2
    else:
        k = 4
    return k


def power_ramp(update):
    """The ramp with tensor arithmetic: min(2 ** (u // 2), 4)."""
    return tf.minimum(2 ** (update // 2), 4)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("schedule", [power_ramp, python_ramp], ids=["tensor", "python"])
def test_a_callable_schedule_in_fit_and_in_a_custom_loop(door, schedule, jit_compile):
    x, y = make_data(14 * 4)
    reference_opt = OPTIMIZERS["adam"]()
    reference = reference_on_windows(
        schedule_windows(14, pairs_length(RAMP)), x, y, 4, reference_opt
    )
    model = make_mlp()
    trainer = make_trainer(door, model, steps=schedule)
    trainer.compile(OPTIMIZERS["adam"](), SCE, jit_compile=jit_compile)
    trainer.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(trainer.optimizer.iterations) == 6
    assert_same_state(trained(door, trainer), trainer.optimizer, reference, reference_opt)

    # And in a custom loop's tf.function.
    model, optimizer = make_mlp(), OPTIMIZERS["adam"]()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=schedule)

    @tf.function(jit_compile=jit_compile)
    def step(xb, yb):
        return acc.step(optimizer, grads_of(model, xb, yb), weight=4)

    applied = [bool(step(x[4 * i:4 * i + 4], y[4 * i:4 * i + 4])) for i in range(14)]
    assert [i + 1 for i, a in enumerate(applied) if a] == [1, 2, 4, 6, 10, 14]
    assert_same_state(model, optimizer, reference, reference_opt)


def test_pairs_may_be_an_array_of_shape_n_by_2():
    acc = gradaccum.GradientAccumulator(make_mlp().trainable_variables, steps=np.array(RAMP))
    assert acc.steps == tuple(RAMP)
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator(make_mlp().trainable_variables, steps={0: 1, 2: 2})
    assert str(info.value) == (
        "`steps` must be an integer >= 1, a list of `(from_update, k)` pairs or a "
        "callable `update_index -> int`. Received: steps={0: 1, 2: 2}"
    )


def test_the_schedule_position_is_saved_and_restored(tmp_path):
    x, y = make_data(14 * 4)
    reference_opt = OPTIMIZERS["adam"]()
    reference = reference_on_windows(
        schedule_windows(14, pairs_length(RAMP)), x, y, 4, reference_opt
    )

    def run(model, optimizer, acc, micro_batches):
        for i in micro_batches:
            grads = grads_of(model, x[4 * i:4 * i + 4], y[4 * i:4 * i + 4])
            acc.step(optimizer, grads, weight=4)

    model, optimizer = make_mlp(), OPTIMIZERS["adam"]()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=RAMP)
    run(model, optimizer, acc, range(8))  # updates 0-3 done, 2 of update 4's 4 in
    assert int(acc.updates) == 4 and int(acc.micro_step) == 2
    path = tf.train.Checkpoint(model=model, optimizer=optimizer, accumulator=acc).write(
        str(tmp_path / "ckpt")
    )

    model2, optimizer2 = make_mlp(seed=5), OPTIMIZERS["adam"]()
    optimizer2.build(model2.trainable_variables)
    acc2 = gradaccum.GradientAccumulator(model2.trainable_variables, steps=RAMP)
    tf.train.Checkpoint(model=model2, optimizer=optimizer2, accumulator=acc2).read(
        path
    ).assert_consumed()
    assert int(acc2.updates) == 4 and int(acc2.state.window_steps) == 4
    run(model2, optimizer2, acc2, range(8, 14))
    assert int(optimizer2.iterations) == 6
    assert_same_state(model2, optimizer2, reference, reference_opt, rtol=1e-6, atol=1e-7)


def test_growing_batches_in_split_mode_are_the_pipelines_schedule(door):
    # Split mode makes each batch one window: a ramp of the batch is the data's
    # (batches of 4, 8, 16, 16 here), each split into micro-batches of 4.
    x, y, starts, dataset = uneven_batches([4, 8, 16, 16])
    reference_opt = OPTIMIZERS["adam"]()
    reference = reference_on_rows(
        x, y, [slice(a, b) for a, b in zip(starts[:-1], starts[1:])], reference_opt
    )
    model = make_mlp()
    trainer = make_trainer(door, model, micro_batch_size=4)
    trainer.compile(OPTIMIZERS["adam"](), SCE)
    history = trainer.fit(dataset, epochs=1, verbose=0)
    assert history.history["updates"] == [4.0]
    assert history.history["window_micro_batches"] == [4.0]
    assert history.history["window_weight"] == [16.0]
    assert_same_state(trained(door, trainer), trainer.optimizer, reference, reference_opt)


def test_a_wrapped_model_keeps_its_schedule_in_its_config():
    trainer = gradaccum.wrap(make_mlp(), steps=RAMP)
    assert trainer.steps == tuple(RAMP)
    config = trainer.get_config()
    assert config["steps"] == [[0, 1], [2, 2], [4, 4]]
    again = gradaccum.AccumulatingModel.from_config(config)
    assert again.steps == tuple(RAMP)
    budget = gradaccum.AccumulatingModel.from_config(
        gradaccum.wrap(make_mlp(), weight_per_update=64).get_config()
    )
    assert budget.weight_per_update == 64.0 and budget.steps is None


# A weight budget --------------------------------------------------------------------

VOCAB, CLASSES, BUDGET = 12, 4, 64


def sequences(n=42, seed=3):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 13, size=n)
    tokens = [rng.integers(1, VOCAB, size=k) for k in lengths]
    labels = [rng.integers(0, CLASSES, size=k) for k in lengths]
    return lengths, tokens, labels


def padded(rows, lengths, tokens, labels):
    """The rows padded to their own longest sequence (0 is the padding)."""
    t = max(lengths[i] for i in rows)
    xs, ys = np.zeros((len(rows), t), "int32"), np.zeros((len(rows), t), "int32")
    for r, i in enumerate(rows):
        xs[r, :lengths[i]], ys[r, :lengths[i]] = tokens[i], labels[i]
    return xs, ys


def sequence_model():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 6, mask_zero=True)(inputs)
    h = keras.layers.Dense(8, activation="tanh")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def per_token_loss(model, xs, ys):
    """The mean of the token losses over the unmasked tokens."""
    losses = keras.losses.sparse_categorical_crossentropy(
        ys, model(xs, training=True), from_logits=True
    )
    mask = tf.cast(xs > 0, losses.dtype)
    return tf.reduce_sum(losses * mask) / tf.reduce_sum(mask)


def budget_windows(token_counts, budget):
    """Micro-batch indices of each window: it closes at the first micro-batch after
    which its tokens reach the budget; the last (partial) one is flushed."""
    windows, open_window, total = [], [], 0
    for i, count in enumerate(token_counts):
        open_window.append(i)
        total += count
        if total >= budget:
            windows.append(open_window)
            open_window, total = [], 0
    if open_window:
        windows.append(open_window)
    return windows


@pytest.fixture(scope="module")
def budget_case():
    lengths, tokens, labels = sequences()
    micro = [list(range(i, i + 3)) for i in range(0, len(lengths), 3)]  # 14 of 3
    counts = [int(sum(lengths[i] for i in mb)) for mb in micro]
    windows = budget_windows(counts, BUDGET)
    return dict(lengths=lengths, tokens=tokens, labels=labels, micro=micro, counts=counts,
                windows=windows)


def budget_reference(case):
    model, optimizer = sequence_model(), keras.optimizers.Adam(0.05)
    for window in case["windows"]:
        rows = [i for mb in window for i in case["micro"][mb]]
        xs, ys = padded(rows, case["lengths"], case["tokens"], case["labels"])
        with tf.GradientTape() as tape:
            loss = per_token_loss(model, xs, ys)
        # Dense gradients: gradaccum applies the window's summed embedding gradient.
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model, optimizer


def test_the_budget_case_has_windows_of_different_lengths(budget_case):
    counts, windows = budget_case["counts"], budget_case["windows"]
    assert len(set(counts)) > 4  # micro-batches of very different token counts
    # Windows of 5, 4 and 3 micro-batches (80, 72, 68 tokens), then a partial one.
    assert [len(w) for w in windows] == [5, 4, 3, 2]
    for window in windows[:-1]:
        total = sum(counts[i] for i in window)
        assert total >= BUDGET and total - counts[window[-1]] < BUDGET
    assert sum(counts[i] for i in windows[-1]) < BUDGET


def test_a_token_budget_in_a_custom_loop(budget_case):
    reference, reference_opt = budget_reference(budget_case)
    model, optimizer = sequence_model(), keras.optimizers.Adam(0.05)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, weight_per_update=BUDGET)

    @tf.function
    def micro_batch(xs, ys):
        with tf.GradientTape() as tape:
            loss = per_token_loss(model, xs, ys)
        grads = tape.gradient(loss, model.trainable_variables)
        return acc.step(optimizer, grads, weight=tf.reduce_sum(tf.cast(xs > 0, tf.float32)))

    closed, held = [], []
    for i, rows in enumerate(budget_case["micro"]):
        if bool(micro_batch(*padded(rows, budget_case["lengths"], budget_case["tokens"],
                                    budget_case["labels"]))):
            closed.append(i)
            held.append((int(acc.last_window_micro_batches), float(acc.last_window_weight)))
    acc.apply(optimizer)  # the partial last window, as fit's "flush"
    windows, counts = budget_case["windows"], budget_case["counts"]
    assert closed == [w[-1] for w in windows[:-1]]
    assert held == [(len(w), float(sum(counts[i] for i in w))) for w in windows[:-1]]
    assert int(optimizer.iterations) == len(windows)
    assert_same_state(model, optimizer, reference, reference_opt, rtol=1e-5, atol=1e-6)


def test_a_token_budget_in_fit_with_a_masked_per_token_loss(door, budget_case):
    reference, reference_opt = budget_reference(budget_case)
    case = budget_case

    def gen():
        for rows in case["micro"]:
            yield padded(rows, case["lengths"], case["tokens"], case["labels"])

    spec = (tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None, None), tf.int32))
    dataset = tf.data.Dataset.from_generator(gen, output_signature=spec)
    model = sequence_model()
    trainer = make_trainer(door, model, weight_per_update=BUDGET)
    # Keras's loss over a masked output is the mean over the unmasked tokens: its
    # normalizer, the micro-batch's weight, is the token count.
    trainer.compile(keras.optimizers.Adam(0.05), SCE)
    logs = BatchLogs()
    history = trainer.fit(dataset, epochs=1, verbose=0, callbacks=[logs])
    windows, counts = case["windows"], case["counts"]
    updates = [int(entry["updates"]) for entry in logs.logs]
    closed = [i for i in range(len(updates)) if updates[i] > (updates[i - 1] if i else 0)]
    # The partial last window is flushed after the data's unknown end, by fit's hook.
    assert closed == [w[-1] for w in windows[:-1]]
    held = [(logs.logs[i]["window_micro_batches"], logs.logs[i]["window_weight"])
            for i in closed]
    assert held == [(len(w), float(sum(counts[i] for i in w))) for w in windows[:-1]]
    assert history.history["updates"] == [float(len(windows))]
    assert history.history["window_weight"] == [float(sum(counts[i] for i in windows[-1]))]
    assert_same_state(trained(door, trainer), trainer.optimizer, reference, reference_opt)


def test_skipped_micro_batches_add_no_weight_to_the_budget():
    model, optimizer = make_mlp(), OPTIMIZERS["sgd"]()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, weight_per_update=8)
    x, y = make_data(4)
    good = grads_of(model, x, y)
    bad = [g * np.inf for g in good]
    with pytest.warns(UserWarning, match="skipped 1 micro-batch"):
        applied = [bool(acc.step(optimizer, g, weight=4)) for g in (good, bad, good)]
    assert applied == [False, False, True]
    assert int(acc.last_window_micro_batches) == 3 and float(acc.last_window_weight) == 8
    assert int(acc.skipped) == 1


# Bad input --------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, -64, float("nan"), float("inf"), True, "64"])
def test_a_budget_must_be_a_finite_number_above_zero(door, budget):
    message = (
        "`weight_per_update` must be a finite number > 0. "
        f"Received: weight_per_update={budget!r}"
    )
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator(make_mlp().trainable_variables, weight_per_update=budget)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        make_trainer(door, make_mlp(), weight_per_update=budget)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "steps, message",
    [
        ([(0, 1), (0, 2)], "sorted by `from_update`"),
        ([(0, 2), (3, 1), (1, 4)], "sorted by `from_update`"),
        ([(1, 1)], "start at update 0"),
        ([(0, 1, 2)], "`(from_update, k)` with integers"),
        ([(0, 0)], "`(from_update, k)` with integers"),
        ([(-1, 2)], "`(from_update, k)` with integers"),
        ([(0, True)], "`(from_update, k)` with integers"),
        ([3], "`(from_update, k)` with integers"),
        ((), "non-empty list"),
    ],
)
def test_bad_schedule_pairs(door, steps, message):
    pattern = f"^`steps` pairs must .*{re.escape(message)}"
    with pytest.raises(ValueError, match=pattern) as info:
        gradaccum.GradientAccumulator(make_mlp().trainable_variables, steps=steps)
    assert str(info.value).endswith(f"Received: steps={steps!r}")
    with pytest.raises(ValueError, match=pattern):
        make_trainer(door, make_mlp(), steps=steps)


@pytest.mark.parametrize(
    "schedule, received",
    [
        (lambda update: 0, "0 for update_index=0"),
        (lambda update: -2, "-2 for update_index=0"),
        (lambda update: 2.0, "a value of dtype float32"),
        (lambda update: tf.cast(update + 1, tf.float64), "a value of dtype float64"),
        (lambda update: update > 0, "a value of dtype bool"),
        (lambda update: "4", "a value of dtype string"),
    ],
)
def test_a_schedule_returning_0_or_a_non_integer_is_refused(door, schedule, received):
    message = f"The `steps` callable must return an integer >= 1. Received: {received}"
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator(make_mlp().trainable_variables, steps=schedule)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        make_trainer(door, make_mlp(), steps=schedule)
    assert str(info.value) == message


def test_a_schedule_returning_0_later_stops_the_traced_step():
    model, optimizer = make_mlp(), OPTIMIZERS["sgd"]()
    # 2 micro-batches for update 0, then 0.
    acc = gradaccum.GradientAccumulator(
        model.trainable_variables, steps=lambda update: 2 - 2 * tf.minimum(update, 1)
    )
    x, y = make_data(2)
    grads = grads_of(model, x, y)

    @tf.function
    def step():
        return acc.step(optimizer, grads)

    assert [bool(step()) for _ in range(2)] == [False, True]
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"The `steps` callable must return an integer >= 1. Received:\] \[0\] "
        r"\[for update_index=\] \[1\]",
    ):
        step()
    # Nothing of the refused micro-batch was accumulated.
    assert int(acc.micro_step) == 0 and int(optimizer.iterations) == 1


def test_steps_and_a_budget_together_are_refused(door):
    message = (
        "`steps` and `weight_per_update` cannot be used together: a window closes after "
        "`steps` micro-batches or once its total weight reaches `weight_per_update`. "
        "Received: steps=4, weight_per_update=64"
    )
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator(make_mlp().trainable_variables, steps=4,
                                      weight_per_update=64)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        make_trainer(door, make_mlp(), steps=4, weight_per_update=64)
    assert str(info.value) == message


def test_a_schedule_or_a_budget_with_micro_batch_size_is_refused(door):
    with pytest.raises(ValueError, match="^`steps` and `micro_batch_size` cannot be used"):
        make_trainer(door, make_mlp(), steps=RAMP, micro_batch_size=4)
    with pytest.raises(
        ValueError, match="^`weight_per_update` and `micro_batch_size` cannot be used"
    ):
        make_trainer(door, make_mlp(), weight_per_update=64, micro_batch_size="auto")


# Several replicas -------------------------------------------------------------------


def test_a_budget_on_two_replicas_is_the_global_windows(door):
    """The budget counts the global window's weight (the replicas' shares summed),
    so both replicas close the same windows, those of one device."""
    from test_distribute import mirrored

    sizes = [3, 9, 5, 12, 7, 2, 10, 6, 8, 4]
    # Windows of 16 samples or more: 3+9+5, 12+7, 2+10+6, then a partial 8+4.
    x, y, starts, dataset = uneven_batches(sizes)
    bounds = [0, 3, 5, 8, 10]
    reference_opt = OPTIMIZERS["adam"]()
    reference = reference_on_rows(
        x, y, [slice(starts[a], starts[b]) for a, b in zip(bounds[:-1], bounds[1:])],
        reference_opt,
    )

    ops = gradaccum.CountingCrossDeviceOps()
    strategy = mirrored(ops)
    with strategy.scope():
        model = make_mlp()
        trainer = make_trainer(door, model, weight_per_update=16)
        trainer.compile(OPTIMIZERS["adam"](), SCE)
    history = trainer.fit(dataset, epochs=1, verbose=0)
    assert history.history["updates"] == [4.0]
    assert history.history["window_micro_batches"] == [2.0]
    assert history.history["window_weight"] == [12.0]
    assert_same_state(model, trainer.optimizer, reference, reference_opt)
    # One batched reduction per update, plus the budget's scalar per micro-batch.
    assert int(ops.reductions) == 4 + len(sizes)


def test_backup_and_restore_on_two_replicas_continues_the_schedule(door, tmp_path):
    """A scheduled fit on 2 replicas that crashes inside a window and resumes under
    BackupAndRestore equals the uninterrupted run (the restored micro-batches are
    skipped outside the compiled step, where the replicas cannot meet)."""
    from test_distribute import mirrored

    strategy = mirrored()
    x, y = make_data(40)  # 5 micro-batches of 8 per epoch

    def run(callbacks=(), seed=0):
        keras.utils.clear_session()
        with strategy.scope():
            model = make_mlp(seed=seed)
            trainer = make_trainer(door, model, steps=RAMP)
            trainer.compile(OPTIMIZERS["adam"](), SCE)
        trainer.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                    callbacks=list(callbacks))
        return model, trainer

    full, full_trainer = run()
    full_weights = full.get_weights()
    # Epoch 1: windows 1, 1, 2 and a flushed 1; epochs 2 and 3: 4 and a flushed 1.
    assert int(full_trainer.optimizer.iterations.numpy()) == 8

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (1, 1):  # the 2nd micro-batch of update 4's 4
                raise RuntimeError("simulated crash")

    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run([keras.callbacks.BackupAndRestore(backup, save_freq=1), Crash()])
    resumed, trainer = run([keras.callbacks.BackupAndRestore(backup, save_freq=1)], seed=11)
    assert int(trainer.optimizer.iterations.numpy()) == 8
    for a, b in zip(resumed.get_weights(), full_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_callable_autograph_cannot_convert_is_refused_when_made(door):
    # Source AutoGraph cannot read (made by exec): Python `if` on the index fails.
    namespace = {}
    exec("def ramp(update):\n    if update < 2:\n        return 1\n    return 4\n", namespace)
    prefix = (
        "The `steps` callable must run in a traced step: written with TensorFlow ops, or "
        "with Python control flow that AutoGraph can convert (its source in a file or a "
        "notebook). Received: a callable that failed on a symbolic update index: "
    )
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator(make_mlp().trainable_variables, steps=namespace["ramp"])
    assert str(info.value).startswith(prefix)
    with pytest.raises(ValueError) as info:
        make_trainer(door, make_mlp(), steps=namespace["ramp"])
    assert str(info.value).startswith(prefix)


def test_a_two_optimizer_own_step_on_two_replicas_with_a_schedule():
    """A GAN-style train_step (two optimizers, raw means) on 2 replicas: its
    accumulators are made in the traced step (the replicas meet for it), and the
    ramp's windows train as Keras's own fit on those windows does on 2 replicas."""
    from test_accumulate import TwoOptimizers, data, seeded
    from test_distribute import mirrored

    # Keras's own fit of this model fails under the default collective all-reduce
    # (a placeholder in its step's optimizer branch): the reference needs another.
    strategy = mirrored(tf.distribute.ReductionToOneDevice())
    x, y = data(64)
    sizes = [8, 8, 16, 16, 16]  # the windows of [(0, 1), (2, 2)] over 8 micro-batches
    starts = np.cumsum([0, *sizes])

    def two_optimizers(accumulated):
        with strategy.scope():
            model = seeded(TwoOptimizers())
            if accumulated:
                gradaccum.accumulate(model, steps=[(0, 1), (2, 2)])
            model.compile(keras.optimizers.Adam(0.05), keras.optimizers.SGD(0.2))
        return model

    reference = two_optimizers(False)
    for a, b in zip(starts[:-1], starts[1:]):  # one batch per window
        reference.fit(x[a:b], y[a:b], batch_size=b - a, epochs=1, verbose=0)
    model = two_optimizers(True)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert history.history["updates"] == [5.0]
    assert int(model.opt_a.iterations.numpy()) == int(model.opt_b.iterations.numpy()) == 5
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
