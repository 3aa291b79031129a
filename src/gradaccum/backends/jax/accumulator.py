"""`GradientAccumulator` on JAX: accumulation for a custom training loop, in the
style of Keras's `optimizer.stateless_apply`.

The accumulator's state is a list of `keras.Variable`s (`variables`: a sum per
variable, and the window's fields packed in two vectors); a jitted step takes their
values and returns new ones, as it does the model's and the optimizer's. What a
micro-batch does to the window is `gradaccum.core.transitions`, the state machine
`fit` runs on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np

from gradaccum.backends.jax.own_step import Applier
from gradaccum.backends.jax.record import Carry, LossScaling, Runner, WindowRecord
from gradaccum.backends.jax.state import Packed
from gradaccum.core import messages, overwrite
from gradaccum.core import transitions as tr
from gradaccum.core.accumulator import Accumulator
from gradaccum.core.combine import REDUCTIONS
from gradaccum.core.hints import DType, Nonfinite, Real, Steps
from gradaccum.core.noise_scale import accumulator_noise
from gradaccum.core.policy import Policy
from gradaccum.core.state import ERROR_FIELDS, FIT, WINDOW, accumulator_name, fields
from gradaccum.core.validation import (
    check_choice,
    check_noise_scale,
    check_nonfinite,
    check_optimizer,
    check_variables,
    check_weight_value,
)
from gradaccum.core.window import WindowRule

__all__ = ["GradientAccumulator"]


class GradientAccumulator(Packed, Accumulator):
    r"""Accumulates micro-batch gradients in a JAX training loop and applies their
    combination, statelessly.

    A window of micro-batches with gradients $g_i$ and weights $w_i$ becomes one
    update with the gradient $G = \sum_i w_i g_i / \sum_i w_i$ (reduction
    `"mean"`): the gradient of the whole window taken as one batch, when $w_i$ is
    the micro-batch's loss normalizer.

    Like Keras's optimizer on JAX (its `stateless_apply`), the accumulator keeps its
    state as arrays that the training step takes and returns: take
    `[v.value for v in acc.variables]`, pass them through your jitted step with the
    model's and the optimizer's, and assign them back when the loop ends. Its
    methods:

    - `stateless_step(optimizer, grads, trainable, optimizer_variables,
      accumulator_variables, weight=n)` adds a micro-batch and, when its window is
      due, makes one optimizer update (the optimizer's `stateless_apply`, inside a
      `lax.cond`: its math runs only when a window closes). Returns the three lists.
    - `stateless_accumulate(grads, accumulator_variables, weight=n)` only adds.
    - `stateless_apply(optimizer, trainable, optimizer_variables,
      accumulator_variables)` applies what the open window holds (a partial window
      at the end of the data, normalized by its own weights) and empties it.

    With a `keras.optimizers.LossScaleOptimizer`, pass gradients of the loss it
    scaled (`optimizer.scale_loss` in a `keras.StatelessScope` mapping its variables
    to `optimizer_variables`): each micro-batch is unscaled into the float32 sums,
    an overflowing one is skipped and the scale backs off, and the window is applied
    with the inner optimizer.

    Args:
        variables: the trainable variables whose gradients are accumulated, in the
            order of the gradient lists passed to `stateless_step` (the optimizer
            must be built with them).
        steps: micro-batches per window: an integer >= 1, sorted `(from_update, k)`
            pairs starting at 0, or a callable `update_index -> int` traceable by JAX
            (`jnp.where`, not a Python `if`). A window's length is read when it
            opens.
        weight_per_update: instead of `steps`, a weight budget: a window closes at
            the first micro-batch after which its total weight reaches it.
        reduction: `"mean"` (default) or `"sum"` ($G = \sum_i g_i$, weights ignored).
        accumulator_dtype: the sums' dtype, float32 by default whatever the
            gradients' (bfloat16 gradients lose nothing).
        nonfinite: a micro-batch whose gradient holds an inf or a nan is `"skip"`ped
            (default: dropped with its weight, counted in `skipped`), `"apply"`ed as
            it is, or `"raise"`s: eagerly at once, inside `jax.jit` (where nothing
            can raise) skipped and recorded, raised by `check`. Or a callable
            `gradients -> bool` (True skips the micro-batch).
        noise_scale: `True`: the accumulator estimates the gradient noise scale
            from each window it applies (its micro-batches' gradients against the
            window's), read by its `noise_scale` property (`reset_noise_scale`
            starts a new reading), in the unit of the weights given.
        name: the name scope of the state's variables.

    Raises:
        ValueError: an empty variable list, invalid `steps` (or a schedule that
            gives something else than an integer >= 1 for update 0),
            `weight_per_update` <= 0 or with `steps`, an unknown `reduction` or
            `nonfinite`, a non-floating `accumulator_dtype`.

    Examples:

        >>> import os; os.environ["KERAS_BACKEND"] = "jax"
        >>> import jax, keras, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> optimizer = keras.optimizers.SGD(0.1)
        >>> optimizer.build(model.trainable_variables)
        >>> acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2)
        >>> def loss_fn(trainable, non_trainable, x, y):
        ...     pred, _ = model.stateless_call(trainable, non_trainable, x)
        ...     return keras.ops.mean((pred - y) ** 2)
        >>> @jax.jit
        ... def train_step(state, x, y):
        ...     trainable, non_trainable, optimizer_vars, acc_vars = state
        ...     grads = jax.grad(loss_fn)(trainable, non_trainable, x, y)
        ...     trainable, optimizer_vars, acc_vars = acc.stateless_step(
        ...         optimizer, grads, trainable, optimizer_vars, acc_vars, weight=x.shape[0])
        ...     return trainable, non_trainable, optimizer_vars, acc_vars
        >>> state = ([v.value for v in model.trainable_variables],
        ...          [v.value for v in model.non_trainable_variables],
        ...          [v.value for v in optimizer.variables],
        ...          [v.value for v in acc.variables])
        >>> x, y = np.ones((12, 3), "float32"), np.zeros((12, 1), "float32")
        >>> for start in (0, 4, 8):  # micro-batches of 4, 4 and 4
        ...     state = train_step(state, x[start:start + 4], y[start:start + 4])
        >>> trainable, non_trainable, optimizer_vars, acc_vars = state
        >>> trainable, optimizer_vars, acc_vars = acc.stateless_apply(
        ...     optimizer, trainable, optimizer_vars, acc_vars)  # the partial window of 1
        >>> for variable, value in zip(acc.variables, acc_vars):
        ...     _ = variable.assign(value)
        >>> int(acc.updates.numpy()), int(acc.micro_step.numpy())
        (2, 0)
    """

    def __init__(self, variables: Sequence[Any], *, steps: Steps | None = None,
                 weight_per_update: Real | None = None, reduction: str = "mean",
                 accumulator_dtype: DType = "float32", nonfinite: Nonfinite = "skip",
                 noise_scale: bool = False, name: str = "gradient_accumulator") -> None:
        from gradaccum.backends.jax.fit import check_accumulator_dtype

        variables = check_variables(variables)
        self._rule = WindowRule(steps, weight_per_update, Runner())
        self.reduction = check_choice("reduction", reduction, REDUCTIONS)
        self.accumulator_dtype = check_accumulator_dtype(accumulator_dtype)
        self.nonfinite = check_nonfinite(nonfinite)
        self.policy = Policy(self._rule, self.reduction, self.nonfinite)
        self.target_variables = tuple(variables)
        weight_dtype = "float64" if self.accumulator_dtype == "float64" else "float32"
        # `received`: a gradient may be missing in some micro-batches only.
        noise = check_noise_scale(accumulator_noise(noise_scale, self._rule),
                                  self.reduction)
        declared = [(field.name, field) for field in fields(WINDOW, noise=noise)]
        declared += [(field.name, field) for field in FIT if field.name in ERROR_FIELDS]
        initial = self.layout(declared, 0, weight_dtype, variables=len(variables))
        with keras.name_scope(name):
            self.accumulators = [
                keras.Variable(np.zeros(v.shape, self.accumulator_dtype), trainable=False,
                               name=accumulator_name(i))
                for i, v in enumerate(variables)
            ]
            self.counts = keras.Variable(np.asarray(initial["counts"], "int32"),
                                         trainable=False, name="counts")
            self.weights = keras.Variable(np.asarray(initial["weights"], weight_dtype),
                                          trainable=False, name="weights")

    def _field(self, name: str) -> Any:
        """The state's field `name` as a view of its packed vector (`numpy`,
        `assign`, `value`)."""
        return Packed.__getattr__(self, name)

    def state_variables(self) -> dict:
        """Every accumulator and field under its stable name (each field as a view
        of its packed vector)."""
        return self.named()

    @property
    def variables(self) -> list:
        """The state's variables, in the order the stateless methods take their
        values: the sums, then `counts` and `weights`."""
        return [*self.accumulators, self.counts, self.weights]

    # The stateless verbs -----------------------------------------------------------------

    def stateless_step(self, optimizer: keras.optimizers.Optimizer, grads: Sequence[Any],
                       trainable_variables: Sequence[Any], optimizer_variables: Sequence[Any],
                       accumulator_variables: Sequence[Any],
                       weight: Any = 1.0) -> tuple[list, list, list]:
        """Adds one micro-batch and, when its window is due, applies it.

        Args:
            optimizer: a built Keras optimizer (a `LossScaleOptimizer` for gradients
                of a scaled loss).
            grads: one gradient per variable (None: no gradient for it in this
                micro-batch).
            trainable_variables: the variables' values.
            optimizer_variables: the optimizer's variables' values
                (`optimizer.variables`' order).
            accumulator_variables: the accumulator's values (`variables`' order).
            weight: the micro-batch's `w_i` (its size, its token count), >= 0.

        Returns:
            `(trainable_variables, optimizer_variables, accumulator_variables)`.
        """
        if self.steps is None and self.weight_per_update is None:
            raise ValueError(
                "`steps` or `weight_per_update` must be given to use `stateless_step`. "
                "Received: steps=None, weight_per_update=None. Pass one of them to "
                "GradientAccumulator, or call `stateless_accumulate` and "
                "`stateless_apply` yourself."
            )
        return self._run(optimizer, grads, trainable_variables, optimizer_variables,
                         accumulator_variables, weight, closes=True)

    def stateless_accumulate(self, grads: Sequence[Any], accumulator_variables: Sequence[Any],
                             weight: Any = 1.0) -> list:
        """Adds one micro-batch without applying anything (gradients of an unscaled
        loss); returns the accumulator's values."""
        trainable = [jnp.zeros((), "float32")] * len(self.target_variables)
        return self._run(None, grads, trainable, [], accumulator_variables, weight,
                         closes=False)[2]

    def stateless_apply(self, optimizer: keras.optimizers.Optimizer,
                        trainable_variables: Sequence[Any], optimizer_variables: Sequence[Any],
                        accumulator_variables: Sequence[Any]) -> tuple[list, list, list]:
        """Applies the open window (full or partial, normalized by its own weights)
        and empties it; nothing with an empty window. Returns
        `(trainable_variables, optimizer_variables, accumulator_variables)`."""
        check_optimizer(optimizer)
        carry, record = self._carry(optimizer, trainable_variables, optimizer_variables,
                                    accumulator_variables)
        tr.apply_now(self.policy, record, True)
        return self._returned(carry)

    def check(self, accumulator_variables: Sequence[Any] | None = None) -> None:
        """Raises the first error a jitted step recorded (a non-finite gradient under
        `nonfinite="raise"`, a schedule's value below 1) in `accumulator_variables`
        (default: the state's variables). The micro-batch that met it was skipped;
        to go on after catching the error, continue with `clear(...)`'s values."""
        window = self._unpacked(accumulator_variables)
        error = int(window["error"])
        if error:
            message = messages.error_message(error, int(window["error_micro_batch"]),
                                       int(window["error_at"]))
            raise (FloatingPointError if error == 1 else ValueError)(message)

    def clear(self, accumulator_variables: Sequence[Any] | None = None) -> list:
        """`accumulator_variables` (default: the state's variables, cleared in place)
        with no error recorded; returns them."""
        values = (list(accumulator_variables) if accumulator_variables is not None
                  else [v.value for v in self.variables])
        window = self._unpacked(values)
        for field in ERROR_FIELDS:
            window[field] = jnp.zeros_like(window[field])
        packed = self.pack(window)
        values = [packed[name] for name in self.carried()]
        if accumulator_variables is None:
            for variable, value in zip(self.variables, values):
                variable.assign(value)
        return values

    def _unpacked(self, accumulator_variables: Sequence[Any] | None) -> dict:
        values = (list(accumulator_variables) if accumulator_variables is not None
                  else [v.value for v in self.variables])
        return self.unpack(dict(zip(self.carried(), values)))

    # Internals ----------------------------------------------------------------------------

    def _carry(self, optimizer: Any, trainable: Sequence[Any], optimizer_variables: Sequence[Any],
               accumulator_variables: Sequence[Any]) -> tuple[Carry, WindowRecord]:
        """The step's values and the window record over them."""
        trainable, optimizer_variables = list(trainable), list(optimizer_variables)
        accumulator_variables = list(accumulator_variables)
        if len(accumulator_variables) != len(self.variables):
            raise ValueError(
                "`accumulator_variables` must be the values of the accumulator's "
                f"`variables` ({len(self.variables)}). Received: "
                f"{len(accumulator_variables)} values."
            )
        fields = self.unpack(dict(zip(self.carried(), accumulator_variables)))
        carry = Carry(trainable, [], optimizer_variables, [], fields)
        applier = Applier(optimizer, tuple(range(len(optimizer_variables))),
                          tuple(range(len(trainable))))
        return carry, WindowRecord(carry, _Owner(self, optimizer), applier)

    def _run(self, optimizer: Any, grads: Sequence[Any], trainable: Sequence[Any],
             optimizer_variables: Sequence[Any], accumulator_variables: Sequence[Any],
             weight: Any, closes: bool) -> tuple[list, list, list]:
        grads = list(grads)
        if len(grads) != len(self.target_variables):
            raise ValueError(
                f"`grads` must have one entry per variable ({len(self.target_variables)})."
                f" Received: {len(grads)} gradients."
            )
        if closes:
            check_optimizer(optimizer)
        carry, record = self._carry(optimizer, trainable, optimizer_variables,
                                    accumulator_variables)
        if not isinstance(weight, jax.core.Tracer):
            # Checked where it is concrete (a traced weight is the caller's, as a
            # symbolic one in a `tf.function` is on TensorFlow).
            check_weight_value(weight)
        weight = jnp.reshape(jnp.asarray(weight, "float32"), ())
        growth = record.step.growth_steps if record.step.loss_scaled else None
        tr.micro_batch(self.policy, record, grads, weight, loss_scale=growth,
                       closes=closes)
        return self._returned(carry)

    def _returned(self, carry: Carry) -> tuple[list, list, list]:
        accumulated = self.pack(carry.fields)
        values = [accumulated[name] for name in self.carried()]
        if not any(isinstance(v, jax.core.Tracer) for v in values):
            # Eagerly (outside jax.jit) an error raises at once.
            self.check(values)
        return carry.trainable, carry.optimizer, values


class _Owner(LossScaling):
    """What a window record needs of its step (`record.WindowRecord`), for one call
    of a `GradientAccumulator` with `optimizer`."""

    # Nothing of privacy in a custom loop.
    privacy = None
    noise_key = None
    # A recorded error (`check`) stops nothing: the micro-batch that met it was
    # skipped, and the loop goes on, as after a caught error on TensorFlow.
    gates_errors = False

    def __init__(self, accumulator: GradientAccumulator, optimizer: Any) -> None:
        super().__init__(optimizer)
        self.variable_dtypes = [v.dtype for v in accumulator.target_variables]
        self.overwrites, self.measured = overwrite.kinds(accumulator.target_variables)
