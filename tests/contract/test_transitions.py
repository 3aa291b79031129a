"""The state machine alone (`gradaccum.core.transitions`), on a record whose fields
and sums are the current backend's tensors in a dict, and whose optimizer is plain
SGD written out here: every transition's values, step by step, on each backend
(this module runs in the TensorFlow and in the JAX process)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum.backend_interface import Record
from gradaccum.core import loss_scaling, messages, noise_scale
from gradaccum.core import state as declared
from gradaccum.core import transitions as tr
from gradaccum.core.policy import Policy
from gradaccum.core.window import WindowRule

ops = keras.ops


class DictRecord(Record):
    """A window record in a dict, eager: the primitives as plain Python."""

    def __init__(self, n_variables=2, loss_scale=None, received=True):
        values = {}
        for field in declared.WINDOW:
            if field.name == "received" and not received:
                continue
            if field.kind == "per_variable":
                values[field.name] = ops.zeros((n_variables,), "float32")
            elif field.kind == "weight":
                values[field.name] = ops.convert_to_tensor(float(field.initial), "float32")
            else:
                values[field.name] = ops.convert_to_tensor(int(field.initial), "int32")
        super().__init__(values)
        self.accumulated = [ops.zeros((3,), "float32") for _ in range(n_variables)]
        self.weights = [np.zeros(3, "float32") for _ in range(n_variables)]
        self.applied = []
        self.failures = []
        self.scale = loss_scale

    def sums(self):
        return list(self.accumulated)

    def dtypes(self):
        return ["float32"] * len(self.accumulated)

    def all_finite(self, gradients):
        return ops.convert_to_tensor(
            all(bool(np.all(np.isfinite(np.asarray(g)))) for g in gradients if g is not None)
        )

    def add_sums(self, gradients, factor, accept):
        if not bool(accept):
            return
        for i, g in enumerate(gradients):
            if g is not None:
                g = ops.convert_to_tensor(g, "float32")
                if factor is not None:
                    g = g * ops.cast(factor, "float32")
                self.accumulated[i] = self.accumulated[i] + g

    def empty_sums(self):
        self.accumulated = [ops.zeros_like(s) for s in self.accumulated]

    def close(self, apply, close, update, finish, empty_sums=True):
        applied = bool(close) and bool(apply) and bool(self.holds())
        if bool(close):
            if applied:
                update()
            finish(ops.convert_to_tensor(applied))
            if empty_sums:
                self.empty_sums()
        return ops.convert_to_tensor(applied)

    def apply(self, gradients):
        self.applied.append([None if g is None else np.asarray(g) for g in gradients])
        for i, g in enumerate(gradients):
            if g is not None:
                self.weights[i] = self.weights[i] - 0.1 * np.asarray(g)

    def fail(self, error, code, at, value=None):
        if bool(error):
            self.failures.append((code, int(at)))

    def loss_scale(self):
        return self.scale

    def set_loss_scale(self, counter, scale):
        self.scale = (counter, scale)


def value(record, name):
    return np.asarray(record.get(name)).item()


def grads(*values):
    return [np.full(3, v, "float32") for v in values]


def run(policy, record, batches, **kwargs):
    """`(gradients, weight)` micro-batches through `micro_batch`; the acceptances."""
    return [bool(tr.micro_batch(policy, record, g, w, **kwargs)) for g, w in batches]


def test_a_window_of_three_applies_the_weighted_mean_once_and_resets():
    record = DictRecord()
    policy = Policy(WindowRule(steps=3))
    run(policy, record, [(grads(1, 2), 1.0), (grads(4, 5), 2.0), (grads(7, 8), 1.0)])
    assert len(record.applied) == 1
    # sum(w g) / sum(w): (1 + 8 + 7) / 4 and (2 + 10 + 8) / 4.
    np.testing.assert_allclose(record.applied[0][0], np.full(3, 4.0))
    np.testing.assert_allclose(record.applied[0][1], np.full(3, 5.0))
    assert value(record, "updates") == 1
    assert value(record, "last_window_micro_batches") == 3
    assert value(record, "last_window_weight") == 4.0
    for name in ("micro_step", "window_skipped", "total_weight"):
        assert value(record, name) == 0
    np.testing.assert_array_equal(np.asarray(record.get("received")), [0, 0])
    assert all(not np.any(np.asarray(s)) for s in record.sums())
    assert value(record, "micro_batches") == 3


def test_before_the_window_is_due_nothing_is_applied():
    record = DictRecord()
    policy = Policy(WindowRule(steps=3))
    run(policy, record, [(grads(1, 2), 1.0), (grads(4, 5), 2.0)])
    assert record.applied == []
    assert value(record, "micro_step") == 2 and value(record, "total_weight") == 3.0
    np.testing.assert_allclose(np.asarray(record.sums()[0]), np.full(3, 9.0))
    np.testing.assert_array_equal(np.asarray(record.get("received")), [2, 2])


def test_sum_reduction_adds_the_gradients_unweighted():
    record = DictRecord()
    policy = Policy(WindowRule(steps=2), reduction="sum")
    run(policy, record, [(grads(1, 2), 5.0), (grads(3, 4), 7.0)])
    np.testing.assert_allclose(record.applied[0][0], np.full(3, 4.0))
    assert value(record, "last_window_weight") == 12.0


def test_a_skipped_micro_batch_counts_towards_the_length_but_not_the_weight():
    record = DictRecord()
    policy = Policy(WindowRule(steps=2))
    accepted = run(policy, record, [(grads(np.inf, 1), 3.0), (grads(2, 2), 1.0)])
    assert accepted == [False, True]
    np.testing.assert_allclose(record.applied[0][0], np.full(3, 2.0))
    assert value(record, "skipped") == 1
    assert value(record, "last_window_micro_batches") == 2
    assert value(record, "last_window_weight") == 1.0


def test_a_window_of_only_skipped_micro_batches_closes_without_an_update():
    record = DictRecord()
    policy = Policy(WindowRule(steps=2))
    run(policy, record, [(grads(np.nan, 1), 1.0), (grads(np.inf, 1), 1.0)])
    assert record.applied == []
    assert value(record, "updates") == 0 and value(record, "window_skipped") == 0
    assert value(record, "skipped") == 2


@pytest.mark.parametrize("nonfinite, accepted, failures", [
    ("apply", [True], []),
    ("raise", [False], [("nonfinite", 1)]),
    (lambda gradients: float(np.asarray(gradients[0])[0]) > 0.5, [False], []),
])
def test_the_nonfinite_policies(nonfinite, accepted, failures):
    record = DictRecord()
    policy = Policy(WindowRule(steps=4), nonfinite=nonfinite)
    g = grads(1.0, 1.0) if callable(nonfinite) else grads(np.nan, 1.0)
    assert run(policy, record, [(g, 1.0)]) == accepted
    assert record.failures == failures


def test_a_schedule_reads_each_windows_length_when_it_opens():
    record = DictRecord()
    policy = Policy(WindowRule(steps=[(0, 1), (2, 2), (4, 4)]))
    applied_after = []
    for i in range(14):
        run(policy, record, [(grads(1, 1), 1.0)])
        if len(record.applied) > len(applied_after):
            applied_after.append(i + 1)
    assert applied_after == [1, 2, 4, 6, 10, 14]
    assert value(record, "window_steps") == 4


def test_a_weight_budget_closes_at_the_first_micro_batch_that_reaches_it():
    record = DictRecord()
    policy = Policy(WindowRule(weight_per_update=10))
    run(policy, record, [(grads(1, 1), w) for w in (4.0, 4.0, 4.0, 12.0, 3.0)])
    assert len(record.applied) == 2
    assert value(record, "last_window_weight") == 12.0
    assert value(record, "total_weight") == 3.0


@pytest.mark.parametrize("partial, applied, open_after", [
    ("flush", 1, 0), ("drop", 0, 0), ("carry", 0, 2),
])
def test_the_end_of_the_data_treats_a_partial_window_as_partial_says(
        partial, applied, open_after):
    record = DictRecord()
    policy = Policy(WindowRule(steps=3), partial=partial)
    run(policy, record, [(grads(1, 1), 1.0)], end=ops.convert_to_tensor(False))
    run(policy, record, [(grads(3, 3), 1.0)], end=ops.convert_to_tensor(True))
    assert len(record.applied) == applied
    assert tr.window_length(record) == open_after
    if applied:
        # A partial window is normalized by its own weights, never scaled by r/k.
        np.testing.assert_allclose(record.applied[0][0], np.full(3, 2.0))


def test_a_missing_gradient_counts_as_zero_and_is_not_received():
    record = DictRecord()
    policy = Policy(WindowRule(steps=2))
    run(policy, record, [([np.ones(3, "float32"), None], 1.0),
                         (grads(3, 5), 1.0)])
    np.testing.assert_allclose(record.applied[0][0], np.full(3, 2.0))
    np.testing.assert_allclose(record.applied[0][1], np.full(3, 2.5))


def test_a_window_of_one_is_applied_from_the_gradients_themselves():
    record = DictRecord()
    policy = Policy(WindowRule(steps=1))
    run(policy, record, [(grads(3, 4), 2.0)], direct=True)
    np.testing.assert_allclose(record.applied[0][0], np.full(3, 3.0))
    assert all(not np.any(np.asarray(s)) for s in record.sums())  # never touched
    assert value(record, "updates") == 1 and value(record, "last_window_weight") == 2.0
    run(policy, record, [(grads(np.nan, 4), 2.0)], direct=True)
    assert len(record.applied) == 1 and value(record, "skipped") == 1


def test_loss_scaling_unscales_backs_off_and_grows_as_keras_counts():
    record = DictRecord(loss_scale=(ops.convert_to_tensor(0, "int32"),
                                    ops.convert_to_tensor(4.0, "float32")))
    policy = Policy(WindowRule(steps=2))
    # Gradients of the scaled loss (scale 4): unscaled into the sums, weighted.
    run(policy, record, [(grads(4, 8), 1.0)], loss_scale=2)
    np.testing.assert_allclose(np.asarray(record.sums()[0]), np.full(3, 1.0))
    assert int(record.scale[0]) == 1 and float(record.scale[1]) == 4.0
    run(policy, record, [(grads(8, 8), 1.0)], loss_scale=2)  # the 2nd finite: grows
    assert int(record.scale[0]) == 0 and float(record.scale[1]) == 8.0
    np.testing.assert_allclose(record.applied[0][0], np.full(3, 1.5))
    run(policy, record, [(grads(np.inf, 8), 1.0)], loss_scale=2)  # backs off
    assert int(record.scale[0]) == 0 and float(record.scale[1]) == 4.0


def test_grown_by_counts_several_finite_steps_at_once():
    counter, scale = loss_scaling.grown_by(ops.convert_to_tensor(1, "int32"),
                                 ops.convert_to_tensor(2.0, "float32"), 7, 3)
    # 1 + 7 = 8 finite steps in a row with growth every 3: doubled twice, 2 left.
    assert int(counter) == 2 and float(scale) == 8.0


def test_a_callable_weight_below_zero_fails_and_counts_as_zero():
    record = DictRecord()
    policy = Policy(WindowRule(steps=2), weighting=lambda x, y, sw: -1.0)
    weight = tr.weigh(policy, np.ones((2, 1)), None, None, [], record)
    assert float(weight) == 0.0
    assert record.failures == [("negative_weight", 1)]


def test_a_callable_weight_of_nan_fails_as_a_negative_one_does():
    record = DictRecord()
    policy = Policy(WindowRule(steps=2), weighting=lambda x, y, sw: float("nan"))
    weight = tr.weigh(policy, np.ones((2, 1)), None, None, [], record)
    assert float(weight) == 0.0
    assert record.failures == [("negative_weight", 1)]


def test_exact_weighting_takes_the_first_normalizer_or_the_size_with_a_warning():
    record = DictRecord()
    policy = Policy(WindowRule(steps=2), weighting="exact")
    assert float(tr.weigh(policy, np.ones((5, 1)), None, None, [7.0], record)) == 7.0
    with pytest.warns(UserWarning, match="found no compiled loss"):
        assert float(tr.weigh(policy, np.ones((5, 1)), None, None, [], record)) == 5.0


def test_decide_under_each_partial_policy():
    yes, no = ops.convert_to_tensor(True), ops.convert_to_tensor(False)
    cases = {
        ("flush", False, True): (True, True),
        ("drop", False, True): (False, True),
        ("carry", False, True): (False, False),
        ("drop", True, True): (True, True),
        ("flush", True, False): (True, True),
    }
    for (partial, is_due, end), expected in cases.items():
        apply, close = tr.decide(Policy(WindowRule(steps=2), partial=partial),
                                 yes if is_due else no, yes if end else no)
        assert (bool(apply), bool(close)) == expected, (partial, is_due, end)
    # An error closes nothing.
    apply, close = tr.decide(Policy(WindowRule(steps=2), partial="flush"), yes, yes,
                             ok=no)
    assert not bool(apply) and not bool(close)


def test_the_error_messages():
    assert messages.error_message("nonfinite", 7, 2).startswith(
        "gradaccum: a gradient is not finite (inf or nan) in micro-batch 7 (counted from "
        "1; the micro-batch 2 of its window)"
    )
    assert messages.error_message("schedule", at=3, value=0) == (
        "The `steps` callable must return an integer >= 1. Received: 0 for update_index=3"
    )
    assert messages.error_message(2, at=4) == (
        "The `weighting` callable must return a weight >= 0. Received: a negative or nan "
        "weight for micro-batch 4 of its window (it was accumulated with weight 0)."
    )


def test_the_fields_are_declared_once_with_the_names_checkpoints_keep():
    noise = tuple(field.name for field in declared.NOISE)
    names = declared.WINDOW_NAMES + declared.FIT_NAMES + noise
    assert len(set(names)) == len(names)
    assert set(declared.RESET) == {"total_weight", "micro_step", "window_skipped",
                                   "received", *declared.NOISE_PIECES}
    assert declared.NOISE_PIECES == noise_scale.PIECES
    assert declared.accumulator_name(3) == "accumulator_3"
