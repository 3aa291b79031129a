"""The gradient accumulator: the one place where gradaccum does its math.

A window of micro-batches ``i`` with gradients ``g_i`` and weights ``w_i`` becomes
one update with the combined gradient

    G = sum_i w_i g_i / sum_i w_i      (reduction "mean")
    G = sum_i g_i                      (reduction "sum")

Everything else in gradaccum (the Keras ``fit()`` integration, distribution, mixed
precision) feeds this class and reuses its variables rather than re-deriving them.

Under ``tf.distribute`` each replica accumulates into its own copy of the state
(sync-on-read variables) without communicating; at the update the sums and the
weight totals of all replicas are reduced in one batched reduction, ``G`` is formed
from the global totals, and the optimizer applies it to every replica's copy of the
variables (see ``_update_across_replicas``).
"""

from __future__ import annotations

import contextlib
import re
import warnings

from gradaccum._tf import require_tensorflow

require_tensorflow()

import tensorflow as tf  # noqa: E402

from gradaccum import _keras_compat as kc  # noqa: E402
from gradaccum._keras_compat import applying_across_replicas, tf_variable  # noqa: E402
from gradaccum._validation import check_choice, check_steps, check_weight_value  # noqa: E402
from gradaccum.batch_norm import batch_normalization_layers  # noqa: E402

REDUCTIONS = ("mean", "sum")
NONFINITE = ("skip", "raise", "apply")
ACCUMULATOR_DTYPES = ("float16", "bfloat16", "float32", "float64")


class _Untracked:
    """Holds objects without making them checkpoint dependencies of a module.

    The accumulator refers to the model's variables but does not own them: a
    checkpoint of the accumulator saves the accumulation state only.
    """

    def __init__(self, value):
        self.value = value


def _variable_name(variable) -> str:
    name = getattr(variable, "path", None) or variable.name
    name = name.split(":")[0]
    return re.sub(r"[^A-Za-z0-9_./-]", "_", name)


def check_accumulator_dtype(accumulator_dtype) -> tf.DType:
    """Returns the accumulator dtype, or raises the fixed-form ValueError."""
    try:
        dtype = tf.as_dtype(accumulator_dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in ACCUMULATOR_DTYPES:
        allowed = ", ".join(repr(d) for d in ACCUMULATOR_DTYPES)
        raise ValueError(
            f"`accumulator_dtype` must be a floating dtype, one of {allowed}. "
            f"Received: accumulator_dtype={accumulator_dtype!r}"
        )
    return dtype


def check_optimizer(optimizer) -> None:
    """Refuses what is not a Keras optimizer, or one that would accumulate gradients
    a second time."""
    if not kc.is_optimizer(optimizer):
        raise ValueError(
            "`optimizer` must be a keras.optimizers.Optimizer. "
            f"Received: optimizer of type {type(optimizer).__name__}"
        )
    if kc.is_loss_scale_optimizer(optimizer):
        optimizer = optimizer.inner_optimizer
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "The optimizer must not accumulate gradients itself when gradaccum "
            "does. Received: gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}. Create the optimizer "
            "without `gradient_accumulation_steps`."
        )


def check_loss_scaling_replicas(strategy) -> None:
    """Refuses loss scaling under several replicas: the loss scale would have to
    agree across replicas on every micro-batch."""
    if strategy.num_replicas_in_sync > 1:
        raise ValueError(
            "Loss scaling with gradaccum is supported on one replica: the loss scale "
            "would have to agree across replicas on every micro-batch. Received: a "
            "LossScaleOptimizer (given, or Keras's under the mixed_float16 policy) "
            f"under {_strategy_name(strategy)} with {strategy.num_replicas_in_sync} "
            "replicas. Use the mixed_bfloat16 policy (no loss scaling) under a strategy."
        )


def _check_variables(variables) -> list:
    try:
        listed = None if isinstance(variables, (str, bytes)) else list(variables)
    except TypeError:
        listed = None
    if not listed:
        raise ValueError(
            "`variables` must be a non-empty list of variables. "
            f"Received: variables={variables!r}"
        )
    for v in listed:
        if not all(hasattr(v, attr) for attr in ("shape", "dtype", "assign")):
            raise ValueError(
                "`variables` must be a non-empty list of variables. "
                f"Received: an element of type {type(v).__name__}: {v!r}"
            )
    return listed


def _all_finite(gradients):
    """Whether every gradient is finite: one sum per gradient (an inf or a nan makes
    its sum non-finite), a single pass that needs no boolean copy of the gradient."""
    sums = [
        tf.reduce_sum(tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g, tf.float32))
        for g in gradients
        if g is not None
    ]
    return tf.reduce_all(tf.math.is_finite(tf.stack(sums))) if sums else tf.constant(True)


def _strategy_name(strategy) -> str:
    return type(strategy).__name__.replace("V1", "")


def distribution_of(variables):
    """The `tf.distribute.Strategy` that created `variables`, or None.

    Raises:
        ValueError: if the variables come from several strategies, or if they are
            not distributed while the strategy in scope has several replicas (the
            model was built outside `strategy.scope()`), or if they belong to a
            strategy other than the one in scope.
    """
    found = {}
    for variable in variables:
        inner = tf_variable(variable)
        if isinstance(inner, tf.distribute.DistributedValues):
            strategy = inner.distribute_strategy
            found[id(strategy)] = strategy
    current = tf.distribute.get_strategy()
    if not found:
        if current.num_replicas_in_sync > 1:
            raise ValueError(
                "The model's variables must be created inside the scope of the "
                f"distribution strategy in use ({_strategy_name(current)} with "
                f"{current.num_replicas_in_sync} replicas). Received: variables created "
                "outside `strategy.scope()`, which the replicas would share. Build the "
                "model and the optimizer inside `with strategy.scope():`, and create "
                "the accumulator (or call `gradaccum.wrap` and `compile`) there too."
            )
        return None
    if len(found) > 1:
        raise ValueError(
            "The variables must all belong to one distribution strategy. Received: "
            f"variables from {len(found)} strategies."
        )
    (strategy,) = found.values()
    if tf.distribute.has_strategy() and current is not strategy:
        raise ValueError(
            "The model's variables belong to another distribution strategy than the "
            f"one in scope. Received: variables of a {_strategy_name(strategy)}, "
            f"scope of a {_strategy_name(current)}. Use one strategy for the model, "
            "the optimizer and gradaccum."
        )
    return strategy


class GradientAccumulator(tf.Module):
    """Accumulates micro-batch gradients and applies their combination.

    The accumulator keeps one float32 (by default) copy of each variable's gradient,
    the total weight of the micro-batches in the open window and their count. It
    works eagerly, inside `tf.function` and with `jit_compile=True`; its state is
    TensorFlow variables, so `tf.train.Checkpoint(accumulator=acc)` saves it and a
    run restored in the middle of a window goes on exactly.

    Under `tf.distribute.MirroredStrategy` or `MultiWorkerMirroredStrategy` (model,
    optimizer and accumulator created inside `strategy.scope()`; `step`, `accumulate`
    and `apply` called inside `strategy.run`), every replica accumulates locally and
    the update makes one batched cross-replica reduction of the sums and weight
    totals: the result equals one device training on the global window, and the
    optimizer's clipping acts on the reduced gradient. The `condition` of `apply_if`
    (and so the window) must be the same on every replica.

    Mixed precision: with a `keras.optimizers.LossScaleOptimizer`, pass gradients of
    `optimizer.scale_loss(loss)`; each micro-batch is unscaled into the float32
    accumulators, and one whose gradient is not finite is skipped with its weight
    (the loss scale backs off as Keras's does, and `skipped` counts it). The update
    is applied by the inner optimizer.

    Args:
        variables: the (trainable) variables whose gradients are accumulated, in the
            order of the gradient lists passed to `accumulate` and `step`.
        steps: micro-batches per window, used by `step`. `None` when the caller
            decides when to `apply`.
        reduction: `"mean"` (default): `G = sum(w_i g_i) / sum(w_i)`, which equals
            the gradient on the concatenated window when `w_i` is the micro-batch's
            loss normalizer (its batch size for a per-sample mean loss, its token
            count for a per-token mean). `"sum"`: `G = sum(g_i)`, weights ignored
            (the learning rate then scales with the window).
        accumulator_dtype: dtype of the accumulators; `"float32"` whatever the
            variables' dtype, so bfloat16/float16 gradients lose nothing.
        nonfinite: what a micro-batch whose gradient holds an inf or a nan does.
            `"skip"` (default): it is dropped with its weight (it still counts
            towards the window's length), `skipped` counts it, and a warning is
            shown once when running eagerly (`fit` warns too). `"raise"`: an
            `InvalidArgumentError` naming the micro-batch (under `jit_compile` the
            check cannot raise: the micro-batch is skipped and counted, and `fit`
            raises after the compiled call). `"apply"`: it is
            accumulated as it is (Keras's behaviour). Under a LossScaleOptimizer
            such micro-batches are always skipped and the loss scale backs off.
        layers: a model or layers (or a list of them) whose
            `gradaccum.BatchNormalization` layers this accumulator drives: their
            moving statistics are updated once per update, from the window's pooled
            statistics. Create the accumulator before the training step is traced.
        name: name scope of the accumulator's variables.

    Raises:
        ValueError: on an empty variable list, invalid `steps`, an unknown
            `reduction` or `nonfinite`, a non-floating `accumulator_dtype`, `layers` that are not
            Keras layers, variables created outside the scope of the distribution
            strategy in use, or `gradaccum.BatchNormalization` layers under a
            strategy with several replicas.

    Example:

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
    """

    def __init__(
        self,
        variables,
        *,
        steps: int | None = None,
        reduction: str = "mean",
        accumulator_dtype="float32",
        layers=None,
        nonfinite: str = "skip",
        name: str = "gradient_accumulator",
    ):
        super().__init__(name=name)
        variables = _check_variables(variables)
        self._steps = check_steps(steps, allow_none=True)
        self._reduction = check_choice("reduction", reduction, REDUCTIONS)
        self._accumulator_dtype = check_accumulator_dtype(accumulator_dtype)
        self._nonfinite = check_choice("nonfinite", nonfinite, NONFINITE)
        self._warned_skip = False
        weight_dtype = tf.float64 if self._accumulator_dtype == tf.float64 else tf.float32
        self._targets = _Untracked(tuple(variables))
        # Variables that got a gradient in some `accumulate` call (known at trace
        # time); the others are left out of the update as Keras leaves out a
        # variable whose gradient is None.
        self._received = _Untracked([False] * len(variables))
        # Whether micro-batches can be skipped (loss scaling seen at trace time):
        # only then must a due window with nothing accumulated be closed explicitly.
        self._skips_possible = _Untracked([self._nonfinite != "apply"])
        strategy = distribution_of(variables)
        batch_norms = batch_normalization_layers(layers)
        if batch_norms and strategy is not None and strategy.num_replicas_in_sync > 1:
            raise ValueError(
                "gradaccum.BatchNormalization pools window statistics on one replica: "
                f"it is not supported under {_strategy_name(strategy)} with "
                f"{strategy.num_replicas_in_sync} replicas. Received: layers with "
                f"{len(batch_norms)} gradaccum.BatchNormalization layer(s)."
            )
        for layer in batch_norms:
            layer._accumulated = True
        self._batch_norms = _Untracked(tuple(batch_norms))
        # Replica-local state: each replica adds to its own copy without
        # communicating. Read across replicas (and saved), sums are summed and the
        # micro-step is the first replica's; restoring spreads them back.
        summed = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
        counted = dict(summed, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        with scope, tf.name_scope(name):
            self._accumulators = [
                tf.Variable(
                    tf.zeros(v.shape, self._accumulator_dtype),
                    name=f"accumulator/{_variable_name(v)}",
                    **summed,
                )
                for v in variables
            ]
            self._micro_step = tf.Variable(
                tf.constant(0, tf.int64), name="micro_step", **counted
            )
            self._total_weight = tf.Variable(
                tf.constant(0, weight_dtype), name="total_weight", **summed
            )
            # Micro-batches skipped for a non-finite gradient: in the open window
            # (they count towards its length) and in all.
            self._window_skipped = tf.Variable(
                tf.constant(0, tf.int64), name="window_skipped", **counted
            )
            self._skipped = tf.Variable(tf.constant(0, tf.int64), name="skipped", **counted)
            # Micro-batches presented since creation, skipped ones included.
            self._micro_batches = tf.Variable(
                tf.constant(0, tf.int64), name="micro_batches", **counted
            )

    # Read-only views -------------------------------------------------------------

    @property
    def steps(self) -> int | None:
        """Micro-batches per window used by `step` (None: the caller decides)."""
        return self._steps

    @property
    def reduction(self) -> str:
        """`"mean"` or `"sum"`."""
        return self._reduction

    @property
    def accumulator_dtype(self) -> tf.DType:
        """The dtype of the accumulators."""
        return self._accumulator_dtype

    @property
    def target_variables(self) -> tuple:
        """The variables whose gradients are accumulated."""
        return self._targets.value

    @property
    def accumulators(self) -> list[tf.Variable]:
        """One accumulator variable per target variable (weighted gradient sums)."""
        return list(self._accumulators)

    @property
    def micro_step(self) -> tf.Variable:
        """Micro-batches accumulated in the open window (int64 variable)."""
        return self._micro_step

    @property
    def total_weight(self) -> tf.Variable:
        """Sum of the weights of the micro-batches in the open window."""
        return self._total_weight

    @property
    def skipped(self) -> tf.Variable:
        """Micro-batches skipped for a non-finite gradient, in all (int64 variable)."""
        return self._skipped

    @property
    def micro_batches(self) -> tf.Variable:
        """Micro-batches presented since creation, skipped ones included (int64)."""
        return self._micro_batches

    @property
    def nonfinite(self) -> str:
        """What happens to a micro-batch with a non-finite gradient."""
        return self._nonfinite

    @property
    def batch_normalization_layers(self) -> tuple:
        """The `gradaccum.BatchNormalization` layers this accumulator drives."""
        return self._batch_norms.value

    def window_length(self):
        """Micro-batches in the open window, skipped ones included (int64 tensor)."""
        return self._micro_step + self._window_skipped

    # Accumulation ----------------------------------------------------------------

    def accumulate(self, gradients, weight=1.0, *, loss_scale_optimizer=None):
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
            A boolean tensor: whether the micro-batch was accumulated (False: skipped
            for a non-finite gradient).

        Raises:
            ValueError: a gradients list of the wrong length, a gradient whose shape
                does not match its variable, or (when executing eagerly) a weight
                that is negative, non-finite or not a scalar; a `loss_scale_optimizer`
                that is not a LossScaleOptimizer, or one under several replicas.
        """
        return self._add(
            gradients, weight, self._reduction == "mean", loss_scale_optimizer
        )

    def accumulate_weighted(self, weighted_gradients, weight, *, loss_scale_optimizer=None):
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

    def _add(self, gradients, weight, scale: bool, loss_scale_optimizer=None):
        self._check_replica_context("accumulate")
        gradients = self._check_gradients(gradients)
        weight = self._check_weight(weight)
        for i, grad in enumerate(gradients):
            if grad is not None:
                self._received.value[i] = True
        if loss_scale_optimizer is None:

            def add():
                self._add_micro_batch(gradients, weight, weight if scale else None)

            return self._screened(gradients, add)
        optimizer = self._check_loss_scale_optimizer(loss_scale_optimizer)
        self._skips_possible.value[0] = True

        def add_unscaled():
            # One multiply per gradient both unscales and weighs.
            factor = tf.math.reciprocal(tf.cast(optimizer.dynamic_scale, weight.dtype))
            self._add_micro_batch(gradients, weight, weight * factor if scale else factor)
            kc.grow_loss_scale(optimizer)
            return tf.constant(True)

        def skip():
            # Under loss scaling an overflow is expected now and then: always skipped.
            self._count_skip()
            kc.back_off_loss_scale(optimizer)
            return tf.constant(False)

        self._micro_batches.assign_add(1)
        return tf.cond(_all_finite(gradients), add_unscaled, skip)

    def _screened(self, gradients, add, windowed: bool = True):
        """Runs `add()` for a micro-batch as `nonfinite` says; returns whether it ran.
        A skipped micro-batch counts towards the open window's length if `windowed`."""
        self._micro_batches.assign_add(1)
        if self._nonfinite == "apply":
            add()
            return tf.constant(True)
        finite = _all_finite(gradients)
        # The error's words around the micro-batch's number and its place in the window.
        words = (
            "gradaccum: a gradient is not finite (inf or nan) in micro-batch",
            "(counted from 1; the micro-batch",
            "of its window): nonfinite=raise stops here. Check the data and the loss of "
            "that micro-batch, or use nonfinite=skip to drop it.",
        )
        if self._nonfinite == "raise" and tf.executing_eagerly():
            if not bool(finite):
                position = int(self.window_length()) + 1
                raise tf.errors.InvalidArgumentError(
                    None,
                    None,
                    f"{words[0]} {int(self._micro_batches)} {words[1]} {position} {words[2]}",
                )
        elif self._nonfinite == "raise":
            check = tf.debugging.Assert(
                finite,
                [words[0], self._micro_batches, words[1], self.window_length() + 1, words[2]],
                summarize=1,
            )
            # Nothing of this micro-batch (nor the update it would close) runs first.
            with tf.control_dependencies([check]):
                finite = tf.identity(finite)

        def accept():
            add()
            return tf.constant(True)

        def skip():
            self._count_skip(windowed)
            return tf.constant(False)

        accepted = tf.cond(finite, accept, skip)
        if tf.executing_eagerly() and not bool(accepted):
            self._warn_skipped()
        return accepted

    def _count_skip(self, windowed: bool = True) -> None:
        if windowed:
            self._window_skipped.assign_add(1)
        self._skipped.assign_add(1)
        for layer in self.batch_normalization_layers:
            layer._discard_micro_batch()

    def _warn_skipped(self, count: int = 1, stacklevel: int = 4) -> None:
        """Warns once per accumulator (eagerly here; `fit` at the end of an epoch)."""
        if self._warned_skip:
            return
        self._warned_skip = True
        warnings.warn(
            f"gradaccum skipped {count} micro-batch(es) whose gradient is not finite "
            "(inf or nan): each is dropped with its weight and counted in `skipped` "
            "(in fit's logs too; nonfinite='skip'; this warning is shown once). Pass "
            "nonfinite='raise' to stop at the first, or nonfinite='apply' for Keras's "
            "behaviour.",
            stacklevel=stacklevel,
        )

    def _apply_single(self, optimizer, gradients):
        """A window of one micro-batch on one device: G = g, applied without going
        through the accumulators, screened as `nonfinite` says."""
        self._prepare_optimizer(optimizer)
        gradients = self._check_gradients(gradients)

        def apply():
            optimizer.apply_gradients(
                [(g, v) for g, v in zip(gradients, self.target_variables) if g is not None]
            )

        return self._screened(gradients, apply, windowed=False)

    def _add_micro_batch(self, gradients, weight, factor) -> None:
        """Adds `factor * g` per variable (`g` when `factor` is None) and counts the
        micro-batch with its weight."""
        for grad, acc in zip(gradients, self._accumulators):
            if grad is None:
                continue
            scale = None if factor is None else tf.cast(factor, acc.dtype)
            if isinstance(grad, tf.IndexedSlices):
                values = tf.cast(grad.values, acc.dtype)
                if scale is not None:
                    values = values * scale
                acc.scatter_add(tf.IndexedSlices(values, grad.indices, grad.dense_shape))
            else:
                grad = tf.cast(grad, acc.dtype)
                if scale is not None:
                    grad = grad * scale
                acc.assign_add(grad)
        self._micro_step.assign_add(1)
        self._total_weight.assign_add(weight)
        for layer in self.batch_normalization_layers:
            layer._accept_micro_batch()

    def gradients(self) -> list:
        """The combined gradient of the open window, without resetting.

        Returns:
            One tensor per target variable, in the variable's dtype (`None` for a
            variable that never received a gradient). With nothing accumulated, or a
            total weight of 0 under reduction `"mean"`, the gradients are zeros.
        """
        return self._combine(
            [acc.read_value() for acc in self._accumulators],
            self._total_weight.read_value(),
        )

    def _combine(self, sums, total_weight) -> list:
        """G from weighted sums and their total weight: the one formula."""
        if self._reduction == "mean":
            scale = tf.math.divide_no_nan(tf.constant(1, total_weight.dtype), total_weight)
        combined = []
        for received, grad, var in zip(self._received_mask(), sums, self.target_variables):
            if not received or grad is None:
                combined.append(None)
                continue
            if self._reduction == "mean":
                grad = grad * tf.cast(scale, grad.dtype)
            combined.append(tf.cast(grad, tf.as_dtype(var.dtype)))
        return combined

    def reset(self) -> None:
        """Empties the open window: accumulators, weight total, micro-step, skips in
        the window and the window statistics of batch normalization layers."""
        for acc in self._accumulators:
            acc.assign(tf.zeros_like(acc))
        self._micro_step.assign(0)
        self._window_skipped.assign(0)
        self._total_weight.assign(tf.zeros_like(self._total_weight))
        for layer in self.batch_normalization_layers:
            layer._reset_window()

    def apply(self, optimizer):
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

    def apply_if(self, optimizer, condition):
        """Applies and resets when `condition` holds and the window is not empty.

        Graph-safe (`tf.cond`); the building block of `step` and of partial-window
        policies (apply at the end of the data).

        Args:
            optimizer: a Keras optimizer.
            condition: a Python or tensor boolean.

        Returns:
            A boolean tensor: whether an update happened.
        """
        if tf.distribute.has_strategy():
            return self._apply_if_distributed(optimizer, condition)
        self._prepare_optimizer(optimizer)
        condition = tf.cast(condition, tf.bool)

        def update():
            self._apply_combined(optimizer, self.gradients())
            return tf.constant(True)

        return tf.cond(
            tf.logical_and(condition, self._micro_step > 0),
            update,
            lambda: self._close_if_empty(condition),
        )

    def _close_if_empty(self, condition):
        """A window due with nothing accumulated (every micro-batch skipped) closes
        without an update."""
        if not self._skips_possible.value[0]:
            return tf.constant(False)

        def close():
            self._window_skipped.assign(0)
            return tf.constant(False)

        return tf.cond(condition, close, lambda: tf.constant(False))

    def _apply_combined(self, optimizer, combined) -> None:
        if kc.is_loss_scale_optimizer(optimizer):
            # The accumulated gradients are unscaled and finite already.
            optimizer = optimizer.inner_optimizer
        optimizer.apply_gradients(
            [(g, v) for g, v in zip(combined, self.target_variables) if g is not None]
        )
        for layer in self.batch_normalization_layers:
            layer._commit_window()
        self.reset()

    # Distribution ----------------------------------------------------------------

    def _apply_if_distributed(self, optimizer, condition):
        strategy = tf.distribute.get_strategy()
        distribution_of(self.target_variables)
        if tf.distribute.in_cross_replica_context():
            # Outside `strategy.run` (e.g. closing a window at the end of the data).
            self._prepare_optimizer(optimizer)
            condition = tf.cast(condition, tf.bool)
            due = tf.logical_and(condition, self._micro_step > 0)
            return self._update_across_replicas_if(strategy, optimizer, due, condition)
        context = tf.distribute.get_replica_context()
        if not getattr(optimizer, "built", True):
            context.merge_call(lambda _: self._prepare_optimizer(optimizer))
        check_optimizer(optimizer)
        condition = tf.cast(condition, tf.bool)
        due = tf.logical_and(condition, self._micro_step > 0)
        # Replicas cannot synchronize inside a tf.cond of a replica function (keras
        # issue 20582), so they meet here on every call, which costs no
        # communication, and the condition is taken in cross-replica context.
        return context.merge_call(
            self._update_across_replicas_if, args=(optimizer, due, condition)
        )

    def _update_across_replicas_if(self, strategy, optimizer, due, condition):
        due = strategy.experimental_local_results(due)[0]
        condition = strategy.experimental_local_results(condition)[0]
        return tf.cond(
            due,
            lambda: self._update_across_replicas(strategy, optimizer),
            lambda: self._close_if_empty(condition),
        )

    def _update_across_replicas(self, strategy, optimizer):
        # The one communication of a window: all sums and weight totals in one
        # batched all-reduce. Every device then holds the same global totals.
        state = [*self._accumulators, self._total_weight]
        reduced = strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, [(v, v) for v in state]
        )
        *sums, total_weight = [strategy.experimental_local_results(r)[0] for r in reduced]
        if kc.is_loss_scale_optimizer(optimizer):
            optimizer = optimizer.inner_optimizer
        with applying_across_replicas(optimizer, strategy):
            self._apply_combined(optimizer, self._combine(sums, total_weight))
        return tf.constant(True)

    def step(self, optimizer, gradients, weight=1.0):
        """Accumulates a micro-batch, and applies when `steps` micro-batches are in.

        Args:
            optimizer: a Keras optimizer.
            gradients: as for `accumulate`.
            weight: as for `accumulate`.

        Returns:
            A boolean tensor: whether this call made an update.

        Raises:
            ValueError: if the accumulator was created without `steps`, or as
                `accumulate` does.
        """
        if self._steps is None:
            raise ValueError(
                "`steps` must be an integer >= 1 to use `step()`. Received: "
                "steps=None. Pass `steps=` to GradientAccumulator, or call "
                "`accumulate()` and `apply()` yourself."
            )
        loss_scale_optimizer = optimizer if kc.is_loss_scale_optimizer(optimizer) else None
        self.accumulate(gradients, weight, loss_scale_optimizer=loss_scale_optimizer)
        return self.apply_if(optimizer, self.window_length() >= self._steps)

    # Internals -------------------------------------------------------------------

    def _received_mask(self) -> list[bool]:
        received = self._received.value
        # Before any accumulate call has been seen (e.g. `apply` traced first),
        # nothing is known: keep every variable.
        return received if any(received) else [True] * len(received)

    def _prepare_optimizer(self, optimizer) -> None:
        check_optimizer(optimizer)
        if not getattr(optimizer, "built", True):
            # Create the slots outside any `tf.cond` branch.
            optimizer.build(list(self.target_variables))

    def _check_loss_scale_optimizer(self, optimizer):
        if not kc.is_loss_scale_optimizer(optimizer):
            raise ValueError(
                "`loss_scale_optimizer` must be a keras.optimizers.LossScaleOptimizer. "
                f"Received: loss_scale_optimizer of type {type(optimizer).__name__}"
            )
        check_loss_scaling_replicas(tf.distribute.get_strategy())
        self._prepare_optimizer(optimizer)
        return optimizer

    def _check_replica_context(self, method: str) -> None:
        if not tf.distribute.has_strategy():
            return
        distribution_of(self.target_variables)
        if tf.distribute.in_cross_replica_context():
            strategy = tf.distribute.get_strategy()
            raise ValueError(
                f"`{method}` must be called in a replica context under "
                f"{_strategy_name(strategy)}: call it inside `strategy.run(...)`, "
                "where each replica adds its own gradients. Received: a call in "
                "cross-replica context."
            )

    def _check_gradients(self, gradients) -> list:
        gradients = list(gradients)
        variables = self.target_variables
        if len(gradients) != len(variables):
            raise ValueError(
                f"`gradients` must have one entry per variable ({len(variables)}). "
                f"Received: {len(gradients)} gradients."
            )
        checked = []
        for grad, var in zip(gradients, variables):
            if grad is not None and not isinstance(grad, tf.IndexedSlices):
                grad = tf.convert_to_tensor(grad)
            if grad is not None:
                sparse = isinstance(grad, tf.IndexedSlices)
                shape = grad.values.shape if sparse else grad.shape
                # IndexedSlices hold rows: only the trailing dimensions must match.
                if not tf.TensorShape(shape[1:] if sparse else shape).is_compatible_with(
                    var.shape[1:] if sparse else var.shape
                ):
                    raise ValueError(
                        f"The gradient of variable '{_variable_name(var)}' must have "
                        f"shape {tuple(var.shape)}. Received: shape={tuple(shape)}"
                    )
            checked.append(grad)
        return checked

    def _check_weight(self, weight):
        if isinstance(weight, tf.Tensor) and not tf.executing_eagerly():
            if weight.shape.rank not in (None, 0) and weight.shape.num_elements() != 1:
                raise ValueError(
                    "`weight` must be a scalar. "
                    f"Received: weight with shape {tuple(weight.shape)}"
                )
        else:
            check_weight_value(weight.numpy() if hasattr(weight, "numpy") else weight)
        weight = tf.cast(weight, self._total_weight.dtype)
        return tf.reshape(weight, ())
