"""GradientAccumulator against one large batch, counters, dtypes and bad input."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from helpers import (
    OPTIMIZERS,
    assert_same_state,
    grads_of,
    make_data,
    make_mlp,
    mean_loss,
)


def split(x, y, sizes):
    """Micro-batches of the given sizes, in order."""
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def windows_of(sizes_per_window, seed=1):
    total = sum(sum(w) for w in sizes_per_window)
    x, y = make_data(total, seed)
    windows, start = [], 0
    for sizes in sizes_per_window:
        n = sum(sizes)
        windows.append(split(x[start : start + n], y[start : start + n], sizes))
        start += n
    return windows


def large_batch_run(opt_name, windows, loss=mean_loss):
    """Reference: one optimizer step per window on the concatenated window."""
    model, opt = make_mlp(), OPTIMIZERS[opt_name]()
    for window in windows:
        x = np.concatenate([mx for mx, _ in window])
        y = np.concatenate([my for _, my in window])
        opt.apply_gradients(zip(grads_of(model, x, y, loss), model.trainable_variables))
    return model, opt


def accumulated_run(opt_name, windows, weight=lambda x: len(x), reduction="mean",
                    wrap=lambda f: f):
    model, opt = make_mlp(), OPTIMIZERS[opt_name]()
    acc = gradaccum.GradientAccumulator(
        model.trainable_variables, steps=len(windows[0]), reduction=reduction
    )

    def micro_step(x, y, w):
        return acc.step(opt, grads_of(model, x, y), weight=w)

    micro_step = wrap(micro_step)
    updated = []
    for window in windows:
        for x, y in window:
            updated.append(bool(micro_step(x, y, tf.constant(weight(x), tf.float32))))
    return model, opt, acc, updated


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_equal_micro_batches_weight_one_match_large_batch(opt_name):
    windows = windows_of([[8, 8, 8, 8]] * 3)
    ref_model, ref_opt = large_batch_run(opt_name, windows)
    model, opt, acc, updated = accumulated_run(opt_name, windows, weight=lambda x: 1.0)
    assert updated == [False, False, False, True] * 3
    assert int(opt.iterations) == 3 and int(acc.micro_step) == 0
    assert_same_state(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_equal_micro_batches_weighted_by_size_match_large_batch(opt_name):
    windows = windows_of([[10, 10, 10]] * 4)
    ref_model, ref_opt = large_batch_run(opt_name, windows)
    model, opt, _, _ = accumulated_run(opt_name, windows)
    assert int(opt.iterations) == 4
    assert_same_state(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_unequal_micro_batches_weighted_by_size_match_large_batch(opt_name):
    windows = windows_of([[16, 16, 8], [5, 20, 15], [1, 2, 37]])
    ref_model, ref_opt = large_batch_run(opt_name, windows)
    model, opt, _, _ = accumulated_run(opt_name, windows)
    assert_same_state(model, opt, ref_model, ref_opt)


def test_uniform_weights_are_not_exact_for_unequal_micro_batches():
    """Why weights exist: the plain 1/k mean misses the large-batch update."""
    windows = windows_of([[16, 16, 8]] * 3)
    ref_model, _ = large_batch_run("sgd", windows)
    model, _, _, _ = accumulated_run("sgd", windows, weight=lambda x: 1.0)
    diff = max(
        np.abs(a - b).max() for a, b in zip(model.get_weights(), ref_model.get_weights())
    )
    assert diff > 1e-4


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_sum_reduction_matches_summed_gradient(opt_name):
    windows = windows_of([[6, 6, 6]] * 3)

    def summed_loss(model, x, y):
        # The large-batch loss whose gradient is sum_i grad(L_i): the sum of the
        # micro-batch means.
        parts = [mean_loss(model, x[i : i + 6], y[i : i + 6]) for i in range(0, 18, 6)]
        return tf.add_n(parts)

    ref_model, ref_opt = large_batch_run(opt_name, windows, loss=summed_loss)
    model, opt, acc, _ = accumulated_run(
        opt_name, windows, weight=lambda x: 123.0, reduction="sum"
    )
    assert acc.reduction == "sum"
    assert_same_state(model, opt, ref_model, ref_opt)


def test_eager_function_and_xla_give_the_same_weights():
    windows = windows_of([[16, 16, 8]] * 3)
    ref_model, ref_opt = large_batch_run("adam", windows)
    results = {}
    for mode, wrap in {
        "eager": lambda f: f,
        "function": tf.function,
        "xla": lambda f: tf.function(f, jit_compile=True),
    }.items():
        model, opt, _, updated = accumulated_run("adam", windows, wrap=wrap)
        assert updated == [False, False, True] * 3, mode
        assert_same_state(model, opt, ref_model, ref_opt)
        results[mode] = model.get_weights()
    for a, b in zip(results["eager"], results["xla"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_counters_and_iterations_advance_once_per_update():
    model, opt = make_mlp(), keras.optimizers.SGD(0.1)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=4)
    x, y = make_data(8)
    seen = []
    for _ in range(10):
        updated = acc.step(opt, grads_of(model, x, y), weight=8)
        seen.append((bool(updated), int(acc.micro_step), float(acc.total_weight),
                     int(opt.iterations)))
    assert [s[0] for s in seen] == [False, False, False, True] * 2 + [False, False]
    assert [s[1] for s in seen] == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert [s[2] for s in seen] == [8, 16, 24, 0, 8, 16, 24, 0, 8, 16]
    assert [s[3] for s in seen] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]


def test_partial_window_is_normalized_by_its_own_weight():
    x, y = make_data(40)
    ref_model, ref_opt = make_mlp(), keras.optimizers.SGD(0.1)
    ref_opt.apply_gradients(zip(grads_of(ref_model, x[:10], y[:10]),
                                ref_model.trainable_variables))
    model, opt = make_mlp(), keras.optimizers.SGD(0.1)
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=4)
    acc.step(opt, grads_of(model, x[:6], y[:6]), weight=6)
    acc.step(opt, grads_of(model, x[6:10], y[6:10]), weight=4)
    assert bool(acc.apply(opt))
    assert int(opt.iterations) == 1 and int(acc.micro_step) == 0
    assert_same_state(model, opt, ref_model, ref_opt)


def test_apply_with_nothing_accumulated_is_a_no_op():
    model, opt = make_mlp(), keras.optimizers.Adam(0.1)
    before = model.get_weights()
    acc = gradaccum.GradientAccumulator(model.trainable_variables)
    assert not bool(acc.apply(opt))
    assert int(opt.iterations) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_gradients_reads_without_resetting():
    v = tf.Variable([0.0, 0.0])
    acc = gradaccum.GradientAccumulator([v])
    acc.accumulate([tf.constant([1.0, 2.0])], weight=1.0)
    acc.accumulate([tf.constant([4.0, 8.0])], weight=3.0)
    np.testing.assert_allclose(acc.gradients()[0], [13 / 4, 26 / 4])
    np.testing.assert_allclose(acc.gradients()[0], [13 / 4, 26 / 4])
    assert int(acc.micro_step) == 2 and float(acc.total_weight) == 4.0
    acc.reset()
    assert int(acc.micro_step) == 0 and float(acc.total_weight) == 0.0
    np.testing.assert_array_equal(acc.accumulators[0], [0.0, 0.0])


def test_none_gradient_keeps_what_was_accumulated():
    a, b = tf.Variable([1.0, 1.0]), tf.Variable([2.0])
    acc = gradaccum.GradientAccumulator([a, b])
    acc.accumulate([tf.constant([1.0, 3.0]), tf.constant([5.0])], weight=2.0)
    acc.accumulate([tf.constant([3.0, 1.0]), None], weight=2.0)
    np.testing.assert_allclose(acc.accumulators[1], [10.0])
    grads = acc.gradients()
    # `b` got nothing in the second micro-batch: it counts as zero there.
    np.testing.assert_allclose(grads[0], [2.0, 2.0])
    np.testing.assert_allclose(grads[1], [2.5])


def test_variable_without_any_gradient_is_left_out_of_the_update():
    """As Keras skips a None gradient, so the optimizer never touches it."""
    used, unused = tf.Variable([1.0]), tf.Variable([1.0])
    opt = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    acc = gradaccum.GradientAccumulator([used, unused], steps=2)
    for _ in range(2):
        acc.step(opt, [tf.constant([1.0]), None])
    assert acc.gradients()[1] is None
    assert float(unused[0]) == 1.0 and float(used[0]) != 1.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_gradients_accumulate_in_float32(dtype):
    v = tf.Variable(tf.zeros([2], dtype))
    acc = gradaccum.GradientAccumulator([v], reduction="sum")
    assert acc.accumulators[0].dtype == tf.float32
    acc.accumulate([tf.constant([256.0, 1.0], dtype)])
    for _ in range(64):
        acc.accumulate([tf.constant([1.0, 1.0], dtype)])
    # 256 + 64 * 1 is exact in float32; in bfloat16, 256 + 1 rounds back to 256.
    np.testing.assert_array_equal(acc.accumulators[0].numpy(), [320.0, 65.0])
    low = tf.constant([256.0, 1.0], dtype)
    for _ in range(64):
        low = low + tf.constant([1.0, 1.0], dtype)
    if dtype == "bfloat16":
        assert float(low[0]) == 256.0
    combined = acc.gradients()[0]
    assert combined.dtype == tf.as_dtype(dtype)
    np.testing.assert_array_equal(combined.numpy().astype("float32"), [320.0, 65.0])


def test_sparse_gradients_match_dense():
    table = tf.Variable(np.arange(12, dtype="float32").reshape(6, 2))
    sparse_acc = gradaccum.GradientAccumulator([table])
    dense_acc = gradaccum.GradientAccumulator([table])
    rows = [([0, 3], [[1.0, 2.0], [3.0, 4.0]], 2.0), ([3, 5, 3], [[1.0, 1.0]] * 3, 3.0)]
    for idx, values, w in rows:
        slices = tf.IndexedSlices(tf.constant(values), tf.constant(idx), tf.constant([6, 2]))
        sparse_acc.accumulate([slices], weight=w)
        dense_acc.accumulate([tf.convert_to_tensor(slices)], weight=w)
    np.testing.assert_allclose(sparse_acc.gradients()[0], dense_acc.gradients()[0])
    np.testing.assert_allclose(
        sparse_acc.gradients()[0][3], (2 * np.array([3.0, 4.0]) + 3 * 2.0) / 5
    )


def test_checkpoint_restores_a_window_in_the_middle(tmp_path):
    windows = windows_of([[8, 8, 8]] * 2)
    ref_model, ref_opt, _, _ = accumulated_run("adam", windows)

    micro = [mb for w in windows for mb in w]
    model, opt = make_mlp(), OPTIMIZERS["adam"]()
    acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, accumulator=acc)
    for x, y in micro[:4]:
        acc.step(opt, grads_of(model, x, y), weight=len(x))
    path = ckpt.write(str(tmp_path / "ckpt"))
    assert int(acc.micro_step) == 1

    keras.utils.clear_session()
    model2, opt2 = make_mlp(seed=7), OPTIMIZERS["adam"]()
    opt2.build(model2.trainable_variables)
    acc2 = gradaccum.GradientAccumulator(model2.trainable_variables, steps=3)
    tf.train.Checkpoint(model=model2, optimizer=opt2, accumulator=acc2).read(
        path
    ).assert_consumed()
    assert int(acc2.micro_step) == 1 and float(acc2.total_weight) == 8.0
    for x, y in micro[4:]:
        acc2.step(opt2, grads_of(model2, x, y), weight=len(x))
    assert_same_state(model2, opt2, ref_model, ref_opt, rtol=1e-6, atol=1e-7)


def test_checkpoint_holds_only_the_accumulation_state():
    model = make_mlp()
    acc = gradaccum.GradientAccumulator(model.trainable_variables)
    names = sorted(v.name for v in acc.variables)
    fields = ("received", "micro_step", "total_weight", "window_skipped", "skipped",
              "micro_batches", "updates", "window_steps", "last_window_micro_batches",
              "last_window_weight")
    assert len(acc.variables) == len(model.trainable_variables) + len(fields)
    for state in fields:
        assert any(n.split("/")[-1].split(":")[0] == state for n in names), state
    assert all(v.dtype == tf.float32 for v in acc.accumulators)
    # One declared record: the checkpoint's variables are the record's, by name.
    named = acc.state_variables()
    assert sorted(named) == sorted(
        [f"accumulator_{i}" for i in range(len(model.trainable_variables))] + list(fields)
    )
    assert {id(v) for v in named.values()} == {id(v) for v in acc.variables}


# Bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps, shown", [(0, "0"), (-1, "-1"), (2.5, "2.5"), ("4", "'4'"), (True, "True")]
)
def test_invalid_steps(steps, shown):
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator([tf.Variable(1.0)], steps=steps)
    assert str(info.value) == (
        "`steps` must be an integer >= 1, a list of `(from_update, k)` pairs or a "
        f"callable `update_index -> int`. Received: steps={shown}"
    )


def test_unknown_reduction():
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator([tf.Variable(1.0)], reduction="avg")
    assert str(info.value) == (
        "`reduction` must be one of 'mean', 'sum'. Received: reduction='avg'"
    )


@pytest.mark.parametrize("variables", [[], (), None])
def test_empty_variable_list(variables):
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator(variables)
    assert str(info.value) == (
        "`variables` must be a non-empty list of variables. "
        f"Received: variables={variables!r}"
    )


def test_non_variable_in_list():
    with pytest.raises(ValueError, match="Received: an element of type str: 'w'"):
        gradaccum.GradientAccumulator([tf.Variable(1.0), "w"])


def test_unsupported_accumulator_dtype():
    with pytest.raises(ValueError) as info:
        gradaccum.GradientAccumulator([tf.Variable(1.0)], accumulator_dtype="int32")
    assert str(info.value) == (
        "`accumulator_dtype` must be a floating dtype, one of 'float16', 'bfloat16', "
        "'float32', 'float64'. Received: accumulator_dtype='int32'"
    )


def test_gradients_of_the_wrong_length():
    acc = gradaccum.GradientAccumulator([tf.Variable(1.0), tf.Variable(2.0)])
    with pytest.raises(ValueError) as info:
        acc.accumulate([tf.constant(1.0)])
    assert str(info.value) == (
        "`gradients` must have one entry per variable (2). Received: 1 gradients."
    )


def test_gradient_of_the_wrong_shape_names_the_variable():
    model = make_mlp()
    acc = gradaccum.GradientAccumulator(model.trainable_variables)
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    grads[2] = tf.zeros((3, 8))
    with pytest.raises(ValueError) as info:
        acc.accumulate(grads)
    name = model.trainable_variables[2].path
    assert str(info.value) == (
        f"The gradient of variable '{name}' must have shape (8, 3). "
        "Received: shape=(3, 8)"
    )


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf"), tf.constant(-2.0)])
def test_negative_or_non_finite_weight_given_eagerly(weight):
    acc = gradaccum.GradientAccumulator([tf.Variable(1.0)])
    shown = float(weight)
    with pytest.raises(ValueError) as info:
        acc.accumulate([tf.constant(1.0)], weight=weight)
    assert str(info.value) == (
        f"`weight` must be a finite number >= 0. Received: weight={shown!r}"
    )
    assert int(acc.micro_step) == 0


def test_non_scalar_weight():
    acc = gradaccum.GradientAccumulator([tf.Variable(1.0)])
    with pytest.raises(ValueError) as info:
        acc.accumulate([tf.constant(1.0)], weight=[1.0, 2.0])
    assert str(info.value) == "`weight` must be a scalar. Received: weight with shape (2,)"


def test_step_needs_steps():
    acc = gradaccum.GradientAccumulator([tf.Variable(1.0)])
    with pytest.raises(
        ValueError, match=r"^`steps` or `weight_per_update` must be given to use `step\(\)`"
    ):
        acc.step(keras.optimizers.SGD(), [tf.constant(1.0)])


def test_optimizer_that_accumulates_itself_is_refused():
    acc = gradaccum.GradientAccumulator([tf.Variable(1.0)], steps=2)
    opt = keras.optimizers.SGD(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="Received: gradient_accumulation_steps=2"):
        acc.step(opt, [tf.constant(1.0)])


def test_accumulate_weighted_equals_accumulate():
    v = tf.Variable([0.0, 0.0])
    plain = gradaccum.GradientAccumulator([v])
    weighted = gradaccum.GradientAccumulator([v])
    for grad, w in (([1.0, 2.0], 3.0), ([5.0, -1.0], 1.0)):
        plain.accumulate([tf.constant(grad)], weight=w)
        weighted.accumulate_weighted([w * tf.constant(grad)], weight=w)
    np.testing.assert_allclose(weighted.gradients()[0], plain.gradients()[0])
    np.testing.assert_allclose(plain.gradients()[0], [8 / 4, 5 / 4])
    assert float(weighted.total_weight) == 4.0 and int(weighted.micro_step) == 2
