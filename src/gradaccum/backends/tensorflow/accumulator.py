"""`GradientAccumulator` on TensorFlow: the accumulator's declared state and its
four verbs, accumulate, step, apply and reset.

What a micro-batch does to the window is `gradaccum.core.transitions` (the state
machine every backend shares); this class holds the state (`state.AccumulatorState`,
TensorFlow variables) and hands the transitions its window record: on one device
`record.VariableRecord`, under a tf.distribute strategy `replicas.ReplicaRecord`
(the one reduction per update). The Keras `fit()` integration, distribution, mixed
precision and batch normalization all go through this class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradaccum._tf import require_tensorflow

require_tensorflow()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradaccum.backends.tensorflow import distributed as dist  # noqa: E402
from gradaccum.backends.tensorflow import keras_compat as kc  # noqa: E402
from gradaccum.backends.tensorflow.batch_norm import batch_normalization_layers  # noqa: E402
from gradaccum.backends.tensorflow.checks import (  # noqa: E402
    check_accumulator_dtype,
    check_gradients,
    check_weight,
)
from gradaccum.backends.tensorflow.finite import NONFINITE, check_nonfinite  # noqa: E402
from gradaccum.backends.tensorflow.record import Runner, VariableRecord  # noqa: E402
from gradaccum.backends.tensorflow.replicas import ReplicaRecord  # noqa: E402
from gradaccum.backends.tensorflow.state import AccumulatorState, Untracked  # noqa: E402
from gradaccum.core import transitions as tr  # noqa: E402
from gradaccum.core.accumulator import StatefulAccumulator  # noqa: E402
from gradaccum.core.combine import REDUCTIONS, combine  # noqa: E402
from gradaccum.core.hints import DType, Nonfinite, Real, Steps  # noqa: E402
from gradaccum.core.noise_scale import accumulator_noise  # noqa: E402
from gradaccum.core.policy import Policy  # noqa: E402
from gradaccum.core.screening import warn_skipped  # noqa: E402
from gradaccum.core.validation import (  # noqa: E402
    check_choice,
    check_loss_scale_optimizer,
    check_noise_scale,
    check_optimizer,
    check_variables,
)
from gradaccum.core.window import WindowRule  # noqa: E402

__all__ = ["GradientAccumulator", "NONFINITE", "REDUCTIONS"]


class GradientAccumulator(tf.Module, StatefulAccumulator):
    r"""Accumulates micro-batch gradients and applies their combination.

    A window of micro-batches with gradients $g_i$ and weights $w_i$ becomes one
    update with the gradient $G = \sum_i w_i g_i / \sum_i w_i$ (reduction
    `"mean"`): the gradient of the whole window taken as one batch, when $w_i$ is
    the micro-batch's loss normalizer.

    The accumulator keeps one sum per variable (float32 by default), the window's
    total weight and its counters (`state`). It works eagerly, inside `tf.function`
    and with `jit_compile=True`. Its state is TensorFlow variables, so
    `tf.train.Checkpoint(accumulator=acc)` saves it, and a run restored in the
    middle of a window goes on exactly. An update touches the variables that had a
    gradient in its window: one with no gradient in the whole window is left out, as
    Keras leaves out a `None` gradient.

    Several replicas: under `tf.distribute.MirroredStrategy` or
    `MultiWorkerMirroredStrategy`, create the model, the optimizer and the
    accumulator inside `strategy.scope()`, and call `step`, `accumulate` and `apply`
    inside `strategy.run`. Every replica accumulates locally; the update makes one
    batched cross-replica reduction of the sums and weight totals. The result equals
    one device training on the global window, and the optimizer's clipping acts on
    the reduced gradient. The `condition` of `apply_if` (and so the window) must be
    the same on every replica.

    Mixed precision: with a `keras.optimizers.LossScaleOptimizer`, pass gradients of
    `optimizer.scale_loss(loss)`. Each micro-batch is unscaled into the float32
    sums; one whose gradient is not finite is skipped with its weight (`skipped`
    counts it). The update is applied by the inner optimizer. On one device the loss
    scale backs off at the skipped micro-batch and grows after
    `dynamic_growth_steps` finite ones, as Keras's does per step.

    Under a strategy each replica checks its own share, and the scale (the same on
    every replica) changes at the update, from the counts the window's one reduction
    carries: it backs off once if any share of the window overflowed; otherwise the
    window's micro-batches count towards its growth.

    Args:
        variables: the (trainable) variables whose gradients are accumulated, in the
            order of the gradient lists passed to `accumulate` and `step`.
        steps: micro-batches per window, used by `step`: an integer >= 1, or a
            schedule by update index (counted from 0): sorted `(from_update, k)`
            pairs starting at 0, such as `[(0, 1), (2, 2), (4, 4)]`, or a callable
            `update_index -> int` given an int64 scalar tensor (it runs in the
            traced step: tensor arithmetic, TensorFlow ops, or Python control flow
            that AutoGraph converts). A window's length is read when it opens.
            `None` when the caller decides when to `apply`.
        weight_per_update: instead of `steps`, a weight budget: `step` closes the
            window at the first micro-batch after which the window's total weight
            reaches it (with token-count weights: about that many tokens per
            update). Under several replicas the total is the global window's (one
            scalar all-reduce per micro-batch).
        reduction: `"mean"` (default): $G = \sum_i w_i g_i / \sum_i w_i$, the
            gradient of the whole window when $w_i$ is the micro-batch's loss
            normalizer (its number of samples for a per-sample mean loss, its number
            of tokens for a per-token mean). `"sum"`: $G = \sum_i g_i$, weights
            ignored (the learning rate then scales with the window).
        accumulator_dtype: dtype of the accumulators; `"float32"` whatever the
            variables' dtype, so bfloat16/float16 gradients lose nothing.
        nonfinite: what happens to a micro-batch whose gradient holds an inf or a
            nan. `"skip"` (default): it is dropped with its weight (it still counts
            towards the window's length), `skipped` counts it, and a warning is
            shown once when running eagerly (`fit` warns too). `"raise"`: an
            `InvalidArgumentError` naming the micro-batch (under `jit_compile`, it
            is skipped and counted, and `fit` raises after the compiled call).
            `"apply"`: it is accumulated as it is (Keras's behaviour). Or a callable
            `gradients -> bool`, given the list passed to `accumulate` (as optax's
            `should_skip_update_fn`): True skips the micro-batch without a warning.
            Under a LossScaleOptimizer such micro-batches are always skipped and the
            loss scale backs off.
        layers: a model or layers (or a list of them) whose
            `gradaccum.BatchNormalization` layers this accumulator drives: their
            moving statistics are updated once per update, from the window's pooled
            statistics. Create the accumulator before the training step is traced.
        noise_scale: `True`: the accumulator estimates the gradient noise scale
            from each window it applies (its micro-batches' gradients against the
            window's), read by its `noise_scale` property (`reset_noise_scale`
            starts a new reading), in the unit of the weights given.
        name: name scope of the accumulator's variables.

    Raises:
        ValueError: on an empty variable list, invalid `steps` (or a schedule
            that returns something else than an integer >= 1 for update 0),
            `weight_per_update` <= 0 or together with `steps`, an unknown
            `reduction` or `nonfinite`, a non-floating `accumulator_dtype`, `layers`
            that are not Keras layers, variables created outside the scope of the
            distribution strategy in use.

    Examples:

        >>> import tensorflow as tf, keras, gradaccum
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> optimizer = keras.optimizers.Adam(1e-2)
        >>> acc = gradaccum.GradientAccumulator(model.trainable_variables, steps=2)
        >>> x, y = tf.ones((8, 3)), tf.zeros((8, 1))
        >>> @tf.function
        ... def train_step(x, y):
        ...     with tf.GradientTape() as tape:
        ...         loss = keras.losses.mean_squared_error(y, model(x))
        ...         loss = tf.reduce_mean(loss)
        ...     grads = tape.gradient(loss, model.trainable_variables)
        ...     return acc.step(optimizer, grads, weight=tf.shape(x)[0])
        >>> [bool(train_step(x[i:i + 4], y[i:i + 4])) for i in (0, 4)]
        [False, True]
        >>> int(optimizer.iterations), int(acc.micro_step)
        (1, 0)

        Windows that vary: a ramp (1 micro-batch for updates 0 and 1, then 2), and a
        weight budget (a window closes once its weights reach 10).

        >>> sgd = keras.optimizers.SGD(0.1)
        >>> grads = [tf.zeros_like(v) for v in model.trainable_variables]
        >>> ramp = gradaccum.GradientAccumulator(
        ...     model.trainable_variables, steps=[(0, 1), (2, 2)])
        >>> [bool(ramp.step(sgd, grads, weight=4)) for _ in range(6)]
        [True, True, False, True, False, True]
        >>> int(ramp.updates), int(ramp.last_window_micro_batches)
        (4, 2)
        >>> budget = gradaccum.GradientAccumulator(
        ...     model.trainable_variables, weight_per_update=10)
        >>> [bool(budget.step(sgd, grads, weight=w)) for w in (4, 4, 4, 12, 3)]
        [False, False, True, True, False]
        >>> float(budget.last_window_weight)
        12.0
    """

    def __init__(
        self,
        variables: Sequence[Any],
        *,
        steps: Steps | WindowRule | None = None,
        weight_per_update: Real | None = None,
        reduction: str = "mean",
        accumulator_dtype: DType = "float32",
        layers: Any = None,
        nonfinite: Nonfinite = "skip",
        noise_scale: bool = False,
        name: str = "gradient_accumulator",
    ) -> None:
        super().__init__(name=name)
        variables = check_variables(variables)
        # The fit integration passes the WindowRule it checked already.
        self._rule = (
            steps if isinstance(steps, WindowRule)
            else WindowRule(steps, weight_per_update, Runner())
        )
        self._reduction = check_choice("reduction", reduction, REDUCTIONS)
        self._accumulator_dtype = check_accumulator_dtype(accumulator_dtype)
        self._nonfinite = check_nonfinite(nonfinite)
        # What the state machine follows (`gradaccum.core.transitions`).
        self._policy = Untracked(Policy(self._rule, self._reduction, self._nonfinite))
        self._warned_skip = False
        # The LossScaleOptimizer whose scale the accumulated gradients carried.
        self._loss_scaling = Untracked(None)
        self._targets = Untracked(tuple(variables))
        # DP-SGD (`gradaccum.Privacy`, set by the fit integration): the window's sums
        # are noised once when it is applied, from this seed and the update count.
        self._privacy = Untracked(None)
        self._noise_seed = None
        strategy = dist.distribution_of(variables)
        dist.check_reduced_dtype(strategy, self._accumulator_dtype)
        batch_norms = batch_normalization_layers(layers)
        for layer in batch_norms:
            layer._accumulated = True
        self._batch_norms = Untracked(tuple(batch_norms))
        with tf.name_scope(name):
            # (The fit integration passes its checked rule: its epochs set k.)
            noise = (noise_scale if isinstance(steps, WindowRule)
                     else accumulator_noise(noise_scale, self._rule))
            self.state = AccumulatorState(variables, self._accumulator_dtype, strategy,
                                          noise=check_noise_scale(noise, self._reduction))

    # Read-only views -------------------------------------------------------------

    @property
    def reduction(self) -> str:
        """`"mean"` or `"sum"`."""
        return self._reduction

    @property
    def accumulator_dtype(self) -> tf.DType:
        """The dtype of the accumulators."""
        return self._accumulator_dtype

    @property
    def nonfinite(self) -> Nonfinite:
        """What happens to a micro-batch with a non-finite gradient (a name or the
        user's callable)."""
        return self._nonfinite

    @property
    def target_variables(self) -> tuple:
        """The variables whose gradients are accumulated."""
        return self._targets.value

    @property
    def batch_normalization_layers(self) -> tuple:
        """The `gradaccum.BatchNormalization` layers this accumulator drives."""
        return self._batch_norms.value

    @property
    def accumulators(self) -> list[tf.Variable]:
        """One accumulator variable per target variable (weighted gradient sums)."""
        return list(self.state.accumulators)

    def _field(self, name: str) -> tf.Variable:
        """The state's field `name` (a variable of `state.AccumulatorState`)."""
        return getattr(self.state, name)

    def state_variables(self) -> dict[str, tf.Variable]:
        """Every variable of the accumulation state under its stable name: the
        record's fields (`state.named()`) and the pending window of each driven
        `gradaccum.BatchNormalization` layer. What the fit integration saves."""
        named = self.state.named()
        for i, layer in enumerate(self.batch_normalization_layers):
            for field in ("window_count", "window_sum", "window_square"):
                named[f"batch_norm_{i}_{field}"] = getattr(layer, field)
        return named

    def window_length(self) -> Any:
        """Micro-batches in the open window, skipped ones included (int64 tensor)."""
        return tr.window_length(self._record())

    def window_due(self) -> Any:
        """Whether the open window is due (a boolean tensor): it holds `steps`
        micro-batches (the schedule's length for this window), or its total weight
        reached `weight_per_update`. False without either."""
        return tr.due(self._policy.value, self._record())

    def _record(self, optimizer: Any = None, direct: bool = False) -> VariableRecord:
        """The window record the state machine reads and writes (the replicas'
        under a strategy)."""
        if tf.distribute.has_strategy():
            return ReplicaRecord(self, optimizer)
        return VariableRecord(self, optimizer, direct)

    # Accumulation ----------------------------------------------------------------

    def accumulate(
        self,
        gradients: Sequence[Any],
        weight: Any = 1.0,
        *,
        loss_scale_optimizer: keras.optimizers.LossScaleOptimizer | None = None,
    ) -> Any:
        """Adds one micro-batch's gradients with its weight.

        Args:
            gradients: one entry per target variable: a tensor, a `tf.IndexedSlices`
                (scatter-added, never densified) or `None` (that variable keeps what
                it had accumulated: its gradient counts as zero here).
            weight: the micro-batch's weight `w_i` (e.g. its batch size or token
                count), a scalar >= 0. Ignored by reduction `"sum"` except in
                `total_weight`.
            loss_scale_optimizer: the `keras.optimizers.LossScaleOptimizer` whose
                `scale_loss` scaled the loss these gradients come from: they are
                unscaled, and if any is not finite the micro-batch is skipped.

        Returns:
            A boolean tensor: whether the micro-batch was accumulated (False:
            skipped).

        Raises:
            ValueError: a gradients list of the wrong length, a gradient whose shape
                does not match its variable, or (when executing eagerly) a weight
                that is negative, non-finite or not a scalar; a `loss_scale_optimizer`
                that is not a LossScaleOptimizer.
        """
        return self._add(gradients, weight, self._reduction == "mean", loss_scale_optimizer)

    def accumulate_weighted(
        self,
        weighted_gradients: Sequence[Any],
        weight: Any,
        *,
        loss_scale_optimizer: keras.optimizers.LossScaleOptimizer | None = None,
    ) -> Any:
        """Adds one micro-batch's gradients that already carry its weight.

        For reduction `"mean"`, pass the gradient of `weight * loss` (scale the loss,
        not every gradient: one multiply instead of one per variable) together with
        the weight itself, which goes to `total_weight`. For reduction `"sum"` this is
        `accumulate`.

        Args:
            weighted_gradients: `w_i * grad(L_i)` per target variable, as in
                `accumulate`.
            weight: `w_i`, a scalar >= 0.
            loss_scale_optimizer: as in `accumulate`.

        Returns:
            As `accumulate`.

        Raises:
            ValueError: as `accumulate`.
        """
        return self._add(weighted_gradients, weight, False, loss_scale_optimizer)

    def _add(self, gradients: Sequence[Any], weight: Any, scale: bool,
             loss_scale_optimizer: Any = None) -> Any:
        return self._run(gradients, weight, weighted=not scale,
                         loss_scale_optimizer=loss_scale_optimizer)

    def _run(self, gradients: Sequence[Any], weight: Any, *, weighted: bool,
             loss_scale_optimizer: Any = None, optimizer: Any = None,
             policy: Policy | None = None, end: Any = None, fit: Any = None,
             direct: bool = False, record: Any = None, unit: Any = None,
             samples: Any = None) -> Any:
        """One micro-batch through the state machine (`core.transitions.micro_batch`):
        accumulated, and where `optimizer` is given, the window closed when it is
        due (or, with `end`, as `policy.partial` says at the end of the data).

        Args:
            gradients, weight: the micro-batch's, checked here.
            weighted: the gradients carry the weight already.
            loss_scale_optimizer: the LossScaleOptimizer that scaled the loss.
            optimizer: the optimizer that applies a window that closes (None: only
                accumulate).
            policy: the fit's `Policy` (its `partial`), else the accumulator's.
            end: whether the data ends with this micro-batch (a boolean tensor).
            fit: the fit record (its largest window).
            direct: a window of one micro-batch, applied from its gradients.
            record: the window record to use (one the step made already).
            unit: the step differentiated `w_i * L_i / unit` (`transitions.loss_unit`).
            samples: the micro-batch's samples (the noise scale's unit; None: its
                weight).

        Returns:
            Whether the micro-batch was accepted (a boolean tensor).
        """
        dist.check_replica_context("accumulate", self.target_variables)
        gradients = check_gradients(gradients, self.target_variables)
        weight = check_weight(weight, self.state.total_weight.dtype)
        growth_steps = None
        if loss_scale_optimizer is not None:
            check_loss_scale_optimizer(loss_scale_optimizer)
            # The scale whose window reacts at the update under a strategy.
            self._loss_scaling = Untracked(loss_scale_optimizer)
            self._prepare_optimizer(loss_scale_optimizer)
            growth_steps = int(loss_scale_optimizer.dynamic_growth_steps)
        if optimizer is not None:
            self._ready(optimizer)
        if record is None:
            record = self._record(optimizer, direct)
        accepted = tr.micro_batch(
            policy or self._policy.value, record, gradients, weight, weighted=weighted,
            loss_scale=growth_steps, end=end, fit=fit, direct=direct,
            closes=optimizer is not None, unit=unit, samples=samples,
        )
        self._warn_if_skipped(accepted)
        return accepted

    def _warn_if_skipped(self, accepted: Any) -> None:
        """Eagerly, under nonfinite="skip": the warning of a skipped micro-batch."""
        if tf.executing_eagerly() and self._nonfinite == "skip" and not bool(accepted):
            self._warn_skipped()

    def _warn_skipped(self, count: int = 1, stacklevel: int = 4) -> None:
        """Warns once per accumulator (eagerly here; `fit` at the end of an epoch)."""
        if not self._warned_skip:
            self._warned_skip = True
            warn_skipped(count, stacklevel=stacklevel + 1)

    # The window's combination -----------------------------------------------------

    def gradients(self) -> list:
        """The combined gradient of the open window, without resetting.

        Returns:
            One tensor per target variable, in the variable's dtype. Eagerly, `None`
            for a variable that received no gradient in the window (inside a
            `tf.function`, zeros). With nothing accumulated, or a total weight of 0
            under reduction `"mean"`, the gradients are zeros.
        """
        state = self.state
        combined = combine(
            [acc.read_value() for acc in state.accumulators], state.total_weight.read_value(),
            self._reduction, [v.dtype for v in self.target_variables],
        )
        if tf.executing_eagerly():
            received = state.received.numpy() > 0
            combined = [g if r else None for g, r in zip(combined, received)]
        return combined

    def reset(self) -> None:
        """Empties the open window: accumulators, received counts, weight total,
        micro-step, skips in the window and the window statistics of batch
        normalization layers."""
        tr.reset(VariableRecord(self))

    def apply(self, optimizer: keras.optimizers.Optimizer) -> Any:
        """Applies the combined gradient of the open window, then resets.

        A full or a partial window is normalized by its own weights (never scaled by
        r/k). With nothing accumulated this is a no-op.

        Args:
            optimizer: a Keras optimizer; it sees one `apply_gradients` call per
                update, so its `iterations`, schedules, clipping, weight decay and
                EMA count updates.

        Returns:
            A boolean tensor: whether an update happened.
        """
        return self.apply_if(optimizer, True)

    def apply_if(self, optimizer: keras.optimizers.Optimizer, condition: Any) -> Any:
        """Applies and resets when `condition` holds and the window is not empty.

        Graph-safe (`tf.cond`); the building block of `step` and of partial-window
        policies (apply at the end of the data). A due window in which every
        micro-batch was skipped closes without an update.

        Args:
            optimizer: a Keras optimizer.
            condition: a Python or tensor boolean.

        Returns:
            A boolean tensor: whether an update happened.
        """
        self._ready(optimizer)
        return tr.apply_now(self._policy.value, self._record(optimizer),
                            tf.cast(condition, tf.bool))

    def close(self, optimizer: keras.optimizers.Optimizer, apply: Any, close: Any,
              fit: Any = None) -> Any:
        """Closes the open window when `close`, applying it when `apply` (the
        decisions of `gradaccum.core.transitions.decide`); `fit`: the fit's record
        (its largest window). Returns whether an update happened."""
        self._ready(optimizer)
        return tr.close(self._policy.value, self._record(optimizer), apply, close, fit=fit)

    def drop(self) -> Any:
        """Discards the open window if it holds a micro-batch (`partial="drop"` at the
        end of the data); returns whether it did."""
        return tr.drop(self._record())

    def _ready(self, optimizer: Any) -> None:
        """The optimizer checked and built before a window it applies closes."""
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            if not getattr(optimizer, "built", True):
                tf.distribute.get_replica_context().merge_call(
                    lambda _: self._prepare_optimizer(optimizer)
                )
            check_optimizer(optimizer)
            return
        self._prepare_optimizer(optimizer)

    def step(self, optimizer: keras.optimizers.Optimizer, gradients: Sequence[Any],
             weight: Any = 1.0) -> Any:
        """Accumulates a micro-batch, and applies when the window is due: `steps`
        micro-batches are in (the schedule's length for this window), or the
        window's total weight reached `weight_per_update`.

        Args:
            optimizer: a Keras optimizer.
            gradients: as for `accumulate`.
            weight: as for `accumulate`.

        Returns:
            A boolean tensor: whether this call made an update.

        Raises:
            ValueError: if the accumulator was created without `steps` or
                `weight_per_update`, or as `accumulate` does.
        """
        if self.steps is None and self.weight_per_update is None:
            raise ValueError(
                "`steps` or `weight_per_update` must be given to use `step()`. "
                "Received: steps=None, weight_per_update=None. Pass one of them to "
                "GradientAccumulator, or call `accumulate()` and `apply()` yourself."
            )
        loss_scale_optimizer = optimizer if kc.is_loss_scale_optimizer(optimizer) else None
        self.accumulate(gradients, weight, loss_scale_optimizer=loss_scale_optimizer)
        return self.apply_if(optimizer, self.window_due())

    # Internals -------------------------------------------------------------------

    def _prepare_optimizer(self, optimizer: Any) -> None:
        check_optimizer(optimizer)
        if not getattr(optimizer, "built", True):
            # Create the slots outside any `tf.cond` branch.
            optimizer.build(list(self.target_variables))
