"""Screening micro-batches whose gradient is not finite, and loss-scale reactions.

`nonfinite` is a policy: one of three ready names or a callable, as optax's
`should_skip_update_fn`:

- `"skip"` (default): a micro-batch whose gradient holds an inf or a nan is dropped
  with its weight, counted, and warned about once;
- `"raise"`: such a micro-batch stops training with an error naming it;
- `"apply"`: every micro-batch is accumulated as it is (Keras's behaviour);
- a callable `gradients -> bool` (a Python or tensor boolean): True skips the
  micro-batch, as `"skip"` does, without a warning.

`screened` runs a micro-batch's accumulation as the policy says; under a
`LossScaleOptimizer` the screening is `loss_scale.add`'s.
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum._validation import (  # noqa: F401 (re-exported)
    NONFINITE,
    check_callable_result,
    check_nonfinite,
)
from gradaccum.backends.tensorflow.branching import rare_cond
from gradaccum.core.screening import (  # noqa: F401 (re-exported)
    RAISE_WORDS,
    raise_message,
    warn_skipped,
)


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def all_finite(gradients):
    """Whether every gradient is finite, as a boolean scalar tensor.

    One sum per gradient decides in the usual case (an inf or a nan makes its sum
    non-finite). A sum that is not finite may also come from a finite gradient whose
    float32 sum overflows: only then does an element-wise check decide, so the
    screen costs one pass and reports no false positive.
    """
    if not any(g is not None for g in gradients):
        return tf.constant(True)
    return tf.cond(sums_finite(gradients), lambda: tf.constant(True),
                   lambda: elementwise_finite(gradients))


def sums_finite(gradients):
    """Whether the sum of every gradient's elements is finite (a boolean scalar): True
    says every gradient is finite; False says one is not, or a float32 sum of finite
    values overflowed (`elementwise_finite` decides then)."""
    sums = [tf.reduce_sum(tf.cast(_values(g), tf.float32)) for g in gradients
            if g is not None]
    if not sums:
        return tf.constant(True)
    return tf.math.is_finite(tf.add_n(sums))


def elementwise_finite(gradients):
    """Whether every element of every gradient is finite (a boolean scalar)."""
    values = [_values(g) for g in gradients if g is not None]
    if not values:
        return tf.constant(True)
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))


def user_skip(nonfinite, gradients):
    """Calls a user's `nonfinite` callable and checks that it gives a boolean scalar."""
    return check_callable_result(
        nonfinite(list(gradients)),
        "nonfinite",
        kind="a boolean (True: skip the micro-batch)",
        scalar="a scalar boolean",
        accepts=lambda dtype: dtype == "bool",
    )


def accept(nonfinite, gradients):
    """Whether a micro-batch is accumulated under `nonfinite`: a boolean tensor, or
    None when the policy never skips (`"apply"`). `"raise"` gives the finiteness;
    the caller raises."""
    if nonfinite == "apply":
        return None
    if callable(nonfinite):
        return tf.logical_not(user_skip(nonfinite, gradients))
    return all_finite(gradients)


def assert_finite(finite, micro_batch, position):
    """A graph assertion that raises nonfinite="raise"'s error when `finite` is False."""
    return tf.debugging.Assert(
        finite,
        [RAISE_WORDS[0], micro_batch, RAISE_WORDS[1], position, RAISE_WORDS[2]],
        summarize=1,
    )


def compiled_raise_message(skipped: int) -> str:
    """nonfinite="raise" under jit_compile: XLA drops the assertion, so fit raises
    after the compiled call."""
    return (
        f"gradaccum: a gradient is not finite (inf or nan) in {skipped} "
        "micro-batch(es) of this compiled call (jit_compile: the micro-batch "
        "was skipped, and the error is raised after the call): "
        "nonfinite=raise stops here. Check the data and the loss, or use "
        "nonfinite=skip to drop such micro-batches."
    )


def screened(accumulator, gradients, add, windowed: bool = True):
    """Runs `add()` for a micro-batch of `accumulator` (a `GradientAccumulator`) as
    its `nonfinite` says; returns whether it ran (a boolean tensor). A skipped
    micro-batch counts towards the open window's length if `windowed`."""
    state, policy = accumulator.state, accumulator.nonfinite
    state.micro_batches.assign_add(1)

    def run():
        add()
        return tf.constant(True)

    def skip():
        count_skip(accumulator, windowed)
        return tf.constant(False)

    if policy == "skip":
        # One branch on the usual path: the sums decide, and only when they are not
        # finite does the element-wise check run (a float32 sum may overflow). That
        # rare branch holds `add` again (at steps=1 an optimizer update): kept whole
        # (`rare_cond`), it is not walked on every micro-batch.
        accepted = tf.cond(
            sums_finite(gradients),
            run,
            lambda: rare_cond(elementwise_finite(gradients), run, skip),
        )
    else:
        accepted = accept(policy, gradients)
        if accepted is None:
            add()
            return tf.constant(True)
        if policy == "raise":
            accepted = _raise_unless(accumulator, accepted)
        accepted = tf.cond(accepted, run, skip)
    if tf.executing_eagerly() and policy == "skip" and not bool(accepted):
        accumulator._warn_skipped()
    return accepted


def _raise_unless(accumulator, finite):
    """nonfinite="raise": the error naming the micro-batch, before anything of it (or
    the update it would close) runs."""
    state = accumulator.state
    if tf.executing_eagerly():
        if not bool(finite):
            raise tf.errors.InvalidArgumentError(
                None,
                None,
                raise_message(int(state.micro_batches), int(accumulator.window_length()) + 1),
            )
        return finite
    check = assert_finite(finite, state.micro_batches, accumulator.window_length() + 1)
    with tf.control_dependencies([check]):
        return tf.identity(finite)


def count_skip(accumulator, windowed: bool = True) -> None:
    """Counts a skipped micro-batch (in the open window if `windowed`) and drops its
    batch normalization statistics."""
    state = accumulator.state
    if windowed:
        state.window_skipped.assign_add(1)
    if not (windowed and tf.distribute.has_strategy()):
        # Under a strategy a replica's skipped shares are counted at the update,
        # summed across replicas (`replicas._update`).
        state.skipped.assign_add(1)
    for layer in accumulator.batch_normalization_layers:
        layer._discard_micro_batch()
