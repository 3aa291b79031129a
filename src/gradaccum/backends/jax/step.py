"""The training step on JAX: one micro-batch, and an update when its window closes.

`TrainStep(model, options, state)` is the model's `train_step(state, data)` while
gradaccum accumulates for it: a pure function of the trainer's state, jitted with it.
It runs the model's own loss (`compute_loss_and_updates`: the forward pass,
`compute_loss`, the compiled loss and regularizers), differentiates the loss weighted
by the micro-batch's weight, adds the gradient to the accumulators, and, when the
window closes, makes one optimizer update with the combined gradient
(`gradaccum.core.combine`) through the optimizer's `stateless_apply` inside a
`lax.cond`: the update's math runs only when a window closes.

A model's own `train_step(state, data)` runs as written instead of Keras's loss; what
it hands to `self.optimizer.stateless_apply` is the micro-batch's gradient. In split
mode (`micro_batch_size`) the batch is cut into micro-batches inside the step (a
`lax.scan`), laid out across a keras.distribution's data shards, and applied once.

Under a `LossScaleOptimizer` (`mixed_float16`) the loss Keras scales is
differentiated; each micro-batch's gradient is unscaled as it is added, an overflow
skips the micro-batch and the scale reacts at once (halved; finite micro-batches
count as Keras's finite steps), and the window is applied with the inner optimizer,
as on TensorFlow.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import keras

from gradaccum import _fit_common
from gradaccum import _keras_common as kc
from gradaccum._validation import check_batch_dimensions
from gradaccum.backends.jax import privacy
from gradaccum.backends.jax.own_step import Applier, Handover, escaped, shares
from gradaccum.backends.jax.state import AccumulationState
from gradaccum.core.combine import combine
from gradaccum.weighting import callable_weight

ERRORS = AccumulationState.ERRORS


def all_finite(gradients):
    """Whether every element of every gradient is finite: one fused reduction per
    gradient (XLA folds it into the pass that makes the gradient), no branch."""
    values = [g for g in gradients if g is not None]
    if not values:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in values]))


class TrainStep:
    """The stateless training step of a model gradaccum accumulates for on JAX.

    Args:
        model: the user's model (Keras's default `train_step`).
        options: the checked `Options`.
        state: the model's `AccumulationState`.
        normalizers: the `NormalizerLog` the compiled losses record `n_i` into.
        own_step: the model's own `train_step(state, data)`, or None (Keras's).
    """

    def __init__(self, model, options, state: AccumulationState, normalizers,
                 own_step=None):
        self.model = model
        self.own_step = own_step
        self.options = options
        self.state = state
        self.normalizers = normalizers
        self.warned_no_compiled_loss = False
        metrics_variables = model.metrics_variables
        ours = {id(v): name for name, v in state.carried().items()}
        # Where the state's variables sit among the trainer's metric variables.
        self.slots = {ours[id(v)]: i for i, v in enumerate(metrics_variables) if id(v) in ours}
        if len(self.slots) != len(ours):
            raise ValueError(
                "gradaccum's state rides in the metric variables Keras's JAX trainer "
                "carries (`model.metrics_variables`, from `model.metrics`). Received: "
                f"model {model.name!r} of class {type(model).__name__} whose `metrics` "
                "leaves out the metrics it tracks; return "
                "`super().metrics + [...]` (or list your metrics in `compile`)."
            )
        optimizer = model.optimizer
        # Who applies the window: the model's optimizer on all the state, unless the
        # model's own step hands its gradients to other optimizers or to part of it
        # (read from the step as it is traced).
        self.appliers = [Applier.whole(optimizer, len(model.trainable_variables))]
        self.appliers_known = own_step is None
        self.variable_dtypes = [v.dtype for v in model.trainable_variables]
        # A LossScaleOptimizer: its own variables (step counter, scale) come first
        # among its variables, then the inner optimizer's.
        self.loss_scaled = kc.is_loss_scale_optimizer(optimizer)
        if self.loss_scaled:
            slot = {id(v): i for i, v in enumerate(optimizer.variables)}
            self.counter_slot = slot[id(optimizer.step_counter)]
            self.scale_slot = slot[id(optimizer.dynamic_scale)]
            self.inner_slots = [slot[id(v)] for v in optimizer.inner_optimizer.variables]
        self.terms = int(state.term_ratios.shape[0])
        # A window of one micro-batch (steps=1) in Keras's step: the micro-batch's
        # gradient is the window's, applied without passing through the accumulators
        # (as TensorFlow's step does): no pass to add it, none to read and reset it.
        self.direct = (own_step is None and not options.split and not self.loss_scaled
                       and options.window.constant == 1 and options.privacy is None)
        # DP-SGD: the root key of the window's noise (`privacy.noised`).
        self.noise_key = None
        if options.privacy is not None:
            self.noise_key = privacy.noise_key(options.privacy.noise_seed())
        # Whether the fit can restore inside an epoch (BackupAndRestore): only then
        # does the step carry the branch that skips micro-batches trained on.
        self.resumable = False

    # The step ---------------------------------------------------------------------

    def __call__(self, state, data, micro_batch_size=None):
        """One batch: a micro-batch (`steps` mode), or in split mode the window cut
        into micro-batches of `micro_batch_size` (the option's unless given: the
        size `"auto"` tries)."""
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        ours = self.state.unpack({name: metrics_variables[i]
                                  for name, i in self.slots.items()})
        if self.options.split:
            size = micro_batch_size or self.options.micro_batch_size
            (logs, trainable, non_trainable, optimizer_variables, metrics_variables,
             ours) = self.split_batch(trainable, non_trainable, optimizer_variables,
                                      metrics_variables, ours, data, size)
        elif self.own_step is not None:
            (logs, trainable, non_trainable, optimizer_variables, metrics_variables,
             ours) = self.own_micro_batch(trainable, non_trainable, optimizer_variables,
                                          metrics_variables, ours, data)
        else:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            (logs, trainable, non_trainable, optimizer_variables, metrics_variables,
             ours) = self.micro_batch(trainable, non_trainable, optimizer_variables,
                                      metrics_variables, ours, x, y, sample_weight)
        logs = dict(logs, **self.counters(optimizer_variables, ours))
        metrics_variables = list(metrics_variables)
        for name, value in self.state.pack(ours).items():
            metrics_variables[self.slots[name]] = value
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

    def micro_batch(self, trainable, non_trainable, optimizer_variables,
                    metrics_variables, ours, x, y, sample_weight):
        """`steps` mode: the batch is one micro-batch of the open window, which it
        may close."""
        ours = dict(ours)
        # The state as the micro-batch found it.
        entry = dict(ours)
        (ours, optimizer_variables, new_non_trainable, new_metrics, loss, y_pred, weight,
         error, gradients) = self.accumulate(trainable, non_trainable, optimizer_variables,
                                             metrics_variables, ours, x, y, sample_weight)
        trainable_after, optimizer_after, window, epoch_step = self.window_end(
            trainable, optimizer_variables, ours, error,
            gradients if self.direct else None,
        )
        logs, metrics_after = self.stateless_metrics(
            new_metrics, loss, weight, lambda: self.model.compute_metrics(
                x, y, y_pred, sample_weight
            )
        )
        after = (trainable_after, list(new_non_trainable), optimizer_after,
                 list(metrics_after), window)
        return (logs, *self.held(after, trainable, non_trainable, optimizer_variables,
                                 metrics_variables, entry, epoch_step))

    def window_end(self, trainable, optimizer_variables, ours, error, direct=None):
        """After a micro-batch of `steps` mode: the window closed (and applied) if
        its rule says so, or at the end of the epoch's data. Returns the trainable
        and optimizer variables, the window and the epoch's position. `direct`: the
        micro-batch's gradients, when they are the window's (`self.direct`)."""
        options = self.options
        micro_step, total_weight = ours["micro_step"], ours["total_weight"]
        epoch_step = ours["epoch_step"] + 1
        length = micro_step + ours["window_skipped"]
        if options.window.steps is not None:
            due = length >= ours["window_steps"]
        else:
            due = total_weight >= options.window.weight_per_update
        end = (ours["epoch_length"] > 0) & (epoch_step >= ours["epoch_length"])
        partial = options.partial
        close = (due | end if partial != "carry" else due) & (error == 0)
        apply = close & (micro_step > 0) & ((partial != "drop") | due)
        trainable, optimizer_variables, window = self.close(
            trainable, optimizer_variables, ours, apply, close, direct=direct
        )
        window["epoch_step"] = epoch_step
        return trainable, optimizer_variables, window, epoch_step

    def own_micro_batch(self, trainable, non_trainable, optimizer_variables,
                        metrics_variables, ours, data):
        """`steps` mode with the model's own `train_step(state, data)`: it runs as
        written, with the gradients it hands to each optimizer's `stateless_apply`
        accumulated (the call returns the variables unchanged) and the window
        applied with those optimizers when it closes."""
        model = self.model
        options = self.options
        ours = dict(ours)
        entry = dict(ours)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        theirs = [i for i in range(len(metrics_variables)) if i not in self.slots.values()]
        step_name = f"{type(model).__name__}.train_step"

        self.normalizers.take()
        with Handover(model).recording(self.state) as handover:
            logs, state = self.own_step(
                (list(trainable), list(non_trainable), list(optimizer_variables),
                 [metrics_variables[i] for i in theirs]),
                data,
            )
        normalizers = self.normalizers.take()
        if options.weighting == "exact" and any(escaped(n) for n in normalizers):
            raise ValueError(
                "weighting='exact' reads each micro-batch's loss normalizer where the "
                "compiled loss computes it; a model's own `train_step` that computes "
                "its loss inside a JAX transformation of its own (`jax.checkpoint`, "
                "`lax.scan`, `vmap`) keeps that value inside it. Received: a normalizer "
                f"that escaped such a transformation in {step_name}. "
                "Pass weighting='uniform' (equal micro-batches) or a `weighting` "
                "callable of the micro-batch."
            )
        if not handover.handed:
            raise ValueError(
                f"The train_step of {type(model).__name__} must hand its gradients to "
                "the model's optimizer (`self.optimizer.stateless_apply(...)`) for "
                "gradaccum to accumulate them. Received: a step that did not call it, "
                "so nothing would be trained."
            )
        self.appliers, gradients = shares(handover.handed, trainable, optimizer_variables,
                                          step_name)
        self.appliers_known = True
        self.check_loss_scaled_appliers(step_name)
        trainable_out, non_trainable_out, optimizer_out, metrics_out = state
        updated = set().union(*(a.variable_slots for a in self.appliers))
        if any(trainable_out[i] is not trainable[i] for i in sorted(updated)):
            raise ValueError(
                "A model's own `train_step` must return the trainable variables each "
                "optimizer's `stateless_apply` gave it, unchanged, for gradaccum to "
                "apply the window's update: the update is made when a window closes, "
                "so what the step does to the variables after that call would act on "
                "the variables before it. Received: "
                f"{step_name} changed them after the call (a "
                "clip or a constraint? put it in the layers' `kernel_constraint` or an "
                "optimizer option)."
            )
        if len(optimizer_out) != len(optimizer_variables) or any(
            a is not b for a, b in zip(optimizer_out, optimizer_variables)
        ):
            raise ValueError(
                "A model's own `train_step` must return the optimizer variables of its "
                "state as the optimizers' `stateless_apply` gave them back: gradaccum "
                "updates them when a window closes. Received: "
                f"{step_name} returned others (an optimizer gradaccum does not reach "
                "as an attribute of the model, or a change of its own?)."
            )
        weight = jax.lax.stop_gradient(
            self.micro_batch_weight(x, y, sample_weight, normalizers)
        )
        if options.reduction == "mean" and not self.loss_scaled:
            gradients = [
                None if g is None else g * weight.astype(g.dtype) for g in gradients
            ]
        before = ours
        ours, optimizer_out, _, error = self.add(
            ours, gradients, weight, normalizers, list(optimizer_out)
        )
        non_trainable_out = kept_unless_accepted(non_trainable_out, non_trainable,
                                                 before, ours)
        trainable_after, optimizer_after, window, epoch_step = self.window_end(
            list(trainable_out), optimizer_out, ours, error
        )
        metrics_after = list(metrics_variables)
        for i, value in zip(theirs, metrics_out):
            metrics_after[i] = value
        after = (trainable_after, list(non_trainable_out), optimizer_after, metrics_after,
                 window)
        return (dict(logs), *self.held(after, trainable, non_trainable, optimizer_variables,
                                       metrics_variables, entry, epoch_step))

    def check_loss_scaled_appliers(self, step_name) -> None:
        """Loss scaling (a `LossScaleOptimizer`) is applied as the model's optimizer
        on its whole state: refused in another arrangement."""
        model = self.model
        scaled = [a for a in self.appliers if kc.is_loss_scale_optimizer(a.optimizer)]
        if not (scaled or self.loss_scaled):
            return
        whole = Applier.whole(model.optimizer, len(model.trainable_variables))
        applier = self.appliers[0]
        if len(self.appliers) != 1 or (
            applier.optimizer is not whole.optimizer
            or applier.optimizer_slots != whole.optimizer_slots
            or applier.variable_slots != whole.variable_slots
        ):
            raise ValueError(
                "On Keras's JAX backend gradaccum scales losses (a LossScaleOptimizer) "
                "for a model's own `train_step` that hands all its gradients to the "
                "model's optimizer, `self.optimizer`, with the state's optimizer "
                f"variables. Received: {step_name} handing them to "
                f"{len(self.appliers)} optimizer(s), a LossScaleOptimizer among them, "
                "or part of them."
            )

    def split_batch(self, trainable, non_trainable, optimizer_variables,
                    metrics_variables, ours, data, size):
        """Split mode: the batch is the window, cut into micro-batches of `size`
        samples run one at a time (a `lax.scan` over the whole ones, then the
        shorter last one if the batch leaves one), and applied once. Under a
        keras.distribution each micro-batch takes an equal part of every data
        shard (`Shards`), so that each device computes on its own samples."""
        ours = dict(ours)
        entry = dict(ours)
        halted = ours["error"] > 0
        batch = batch_size(data)
        shards = Shards.of_batch(size)
        if batch % shards.count:
            raise ValueError(
                "A batch split into micro-batches under a keras.distribution must hold "
                "a multiple of the number of devices it is sharded over. Received: a "
                f"batch of {batch} samples sharded over {shards.count} devices"
            )
        part = size // shards.count
        whole, rest = divmod(batch // shards.count, part)
        trainable = list(trainable)

        def run(carry, micro):
            non_trainable, optimizer_variables, metrics_variables, ours, weighted, weights = carry
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(micro)
            (ours, optimizer_variables, non_trainable, metrics_variables, loss, y_pred,
             weight, _, _) = self.accumulate(trainable, non_trainable, optimizer_variables,
                                             metrics_variables, ours, x, y, sample_weight)
            _, metrics_variables = self.stateless_metrics(
                metrics_variables, None, None,
                lambda: self.model.compute_metrics(x, y, y_pred, sample_weight),
            )
            weight = weight.astype("float32")
            weighted = weighted + loss.astype("float32") * weight
            carry = (list(non_trainable), list(optimizer_variables),
                     list(metrics_variables), ours, weighted, weights + weight)
            return carry, None

        # The batch's sums start from zero in the step (the state keeps none).
        for i, variable in enumerate(trainable):
            ours[f"accumulator_{i}"] = jnp.zeros(variable.shape, entry[f"accumulator_{i}"].dtype)
        zero = jnp.zeros((), "float32")
        carry = (list(non_trainable), list(optimizer_variables), list(metrics_variables),
                 ours, zero, zero)
        stacked, tail = shards.cut(data, whole, part, rest)
        if whole == 1:
            carry, _ = run(carry, jax.tree_util.tree_map(lambda t: t[0], stacked))
        elif whole > 1:
            carry, _ = jax.lax.scan(run, carry, stacked)
        if rest:
            carry, _ = run(carry, tail)
        (new_non_trainable, new_optimizer, new_metrics, ours, weighted,
         weights) = carry

        if self.loss_scaled:
            new_optimizer = self.grow(new_optimizer, ours["skipped"] == entry["skipped"])
        # An error in this batch (a non-finite gradient with nonfinite="raise", a
        # negative weight) leaves no update and no window: fit raises after the call.
        failed = (ours["error"] > 0) & ~halted
        apply = (ours["micro_step"] > 0) & ~failed
        trainable_after, optimizer_after, window = self.close(
            trainable, new_optimizer, ours, apply, jnp.asarray(True)
        )
        epoch_step = ours["epoch_step"] + 1
        window["epoch_step"] = epoch_step
        for i in range(len(trainable)):
            window[f"accumulator_{i}"] = entry[f"accumulator_{i}"]
        # The batch's loss, logged as Keras logs a step's on the whole batch.
        loss = jnp.where(weights > 0, weighted / jnp.where(weights > 0, weights, 1.0), 0.0)
        logs, metrics_after = self.stateless_metrics(
            new_metrics, loss, jnp.asarray(batch, "float32"), self.model.get_metrics_result
        )
        after = (trainable_after, list(new_non_trainable), optimizer_after,
                 list(metrics_after), window)
        if self.raises:
            errors = {field: window[field] for field in ERROR_FIELDS}
            before = (trainable, list(non_trainable), list(optimizer_variables),
                      list(metrics_variables), dict(entry, **errors))
            after = jax.tree_util.tree_map(
                lambda new, old: jnp.where(failed, old, new), after, before
            )
        return (logs, *self.held(after, trainable, non_trainable, optimizer_variables,
                                 metrics_variables, entry, epoch_step))

    def accumulate(self, trainable, non_trainable, optimizer_variables,
                   metrics_variables, ours, x, y, sample_weight):
        """One micro-batch's gradient added to the window `ours` (unless it is
        skipped or has an error). Returns the window, the optimizer's variables (a
        loss scale reacts), the forward pass's non-trainable and metric variables,
        the unscaled loss, the predictions, the micro-batch's weight and its error
        code (0: none)."""
        model = self.model
        options = self.options
        mean = options.reduction == "mean"
        ours = dict(ours)
        if options.privacy is not None:
            return self.private_accumulate(trainable, non_trainable, optimizer_variables,
                                           metrics_variables, ours, x, y, sample_weight)

        def objective(trainable, non_trainable, metrics_variables):
            self.normalizers.take()
            loss, aux = model.compute_loss_and_updates(
                trainable, non_trainable, metrics_variables, x, y, sample_weight,
                training=True, optimizer_variables=optimizer_variables,
            )
            normalizers = self.normalizers.take()
            weight = jax.lax.stop_gradient(
                self.micro_batch_weight(x, y, sample_weight, normalizers)
            )
            # Under loss scaling the weight comes with the unscaling instead, so
            # that the scaled loss is the one Keras scales (no extra overflows).
            weigh_loss = mean and not self.loss_scaled and not self.direct
            value = loss * weight.astype(loss.dtype) if weigh_loss else loss
            return value, (aux, weight, normalizers)

        (_, (aux, weight, normalizers)), gradients = jax.value_and_grad(
            objective, has_aux=True
        )(trainable, non_trainable, metrics_variables)
        unscaled_loss, y_pred, new_non_trainable, new_metrics = aux

        before = ours
        ours, optimizer_variables, weight, error = self.add(
            ours, gradients, weight, normalizers, optimizer_variables
        )
        new_non_trainable = kept_unless_accepted(new_non_trainable, non_trainable,
                                                 before, ours)
        return (ours, optimizer_variables, new_non_trainable, new_metrics, unscaled_loss,
                y_pred, weight, error, gradients)

    def private_accumulate(self, trainable, non_trainable, optimizer_variables,
                           metrics_variables, ours, x, y, sample_weight):
        """`accumulate` with `gradaccum.Privacy`: the sum of the examples' clipped
        gradients, weighted by the number of examples (the window's noise is added
        when it is applied). The loss is the micro-batch's, as Keras computes it."""
        model = self.model
        gradients, weight, y_pred, new_non_trainable = privacy.clipped_micro_batch(
            model, self.options.privacy, trainable, non_trainable, x, y, sample_weight
        )
        loss, (_, _, new_metrics) = model.stateless_compute_loss(
            trainable, new_non_trainable, metrics_variables, x=x, y=y, y_pred=y_pred,
            sample_weight=sample_weight, training=True,
        )
        before = ours
        ours, optimizer_variables, weight, error = self.add(
            ours, gradients, weight, None, optimizer_variables
        )
        new_non_trainable = kept_unless_accepted(new_non_trainable, non_trainable,
                                                 before, ours)
        return (ours, optimizer_variables, new_non_trainable, new_metrics, loss, y_pred,
                weight, error, gradients)

    def add(self, ours, gradients, weight, normalizers, optimizer_variables):
        """One micro-batch's gradients (weighted already, except under loss scaling)
        added to the window `ours` unless skipped or in error. Returns the window, the
        optimizer's variables (a loss scale reacts), the weight and the error code."""
        options = self.options
        mean = options.reduction == "mean"
        ours = dict(ours)
        error = jnp.asarray(0, "int32")
        if callable(options.weighting):
            negative = weight < 0
            error = jnp.where(negative, ERRORS["negative_weight"], error)
            weight = jnp.maximum(weight, 0.0)
        if normalizers and len(normalizers) > 1:
            ours = self.track_term_ratios(ours, normalizers)

        accept = self.accepts(gradients)
        finite = all_finite(gradients) if options.nonfinite == "raise" else None
        if self.loss_scaled:
            # An overflow is expected now and then: always skipped, never raised.
            gradients, accept, optimizer_variables = self.unscale(
                gradients, weight if mean else None, accept, optimizer_variables
            )
            finite = None
        if finite is not None:
            error = jnp.where(finite, error, ERRORS["nonfinite"])
        # A window opens: its length is the schedule's at the update it will make.
        opening = (ours["micro_step"] + ours["window_skipped"]) == 0
        if options.window.steps is not None:
            length = options.window.length(ours["updates"])
            if callable(options.window.steps):
                error = jnp.where(opening & (length < 1), ERRORS["schedule"], error)
                length = jnp.maximum(length, 1)
            ours["window_steps"] = jnp.where(opening, length, ours["window_steps"])
        # The first error is kept until fit raises it: where it happened (the
        # micro-batch's place in its window; the update index for a schedule's).
        position = ours["micro_step"] + ours["window_skipped"] + 1
        where = jnp.where(error == ERRORS["schedule"], ours["updates"], position)
        first = (ours["error"] == 0) & (error > 0)
        ours["error_at"] = jnp.where(first, where, ours["error_at"])
        ours["error_micro_batch"] = jnp.where(
            first, ours["micro_batches"] + 1, ours["error_micro_batch"]
        )
        ours["error"] = jnp.where(first, error, ours["error"])
        ours["micro_batches"] = ours["micro_batches"] + 1
        # A micro-batch with an error changes nothing but the counters: it is not
        # accumulated and closes no window (fit raises after the call).
        accept = accept & (error == 0)

        weight = weight.astype(ours["total_weight"].dtype)
        for i, g in enumerate(gradients):
            # No gradient for this variable: zero in this micro-batch. `direct`: the
            # gradient goes to the update as it is, not through the accumulator.
            if g is None or self.direct:
                continue
            total = ours[f"accumulator_{i}"]
            ours[f"accumulator_{i}"] = jnp.where(accept, total + g.astype(total.dtype), total)
        ours["total_weight"] = ours["total_weight"] + jnp.where(accept, weight, 0)
        ours["micro_step"] = ours["micro_step"] + accept.astype("int32")
        ours["window_skipped"] = ours["window_skipped"] + (~accept).astype("int32")
        ours["skipped"] = ours["skipped"] + (~accept).astype("int32")
        return ours, optimizer_variables, weight, error

    def held(self, after, trainable, non_trainable, optimizer_variables,
             metrics_variables, entry, epoch_step):
        """The step's result, or the state it found where the batch changes nothing
        but the epoch's position: a restored run's batch already trained on
        (BackupAndRestore inside an epoch), or after an error (the rest of a
        compiled call of several batches, before fit raises: nothing at all)."""
        if not (self.resumable or self.raises):
            return after
        halted = entry["error"] > 0
        hold = (entry["resume_skip"] > 0) | halted
        before = (list(trainable), list(non_trainable), list(optimizer_variables),
                  list(metrics_variables),
                  dict(entry, epoch_step=jnp.where(halted, entry["epoch_step"], epoch_step)))
        after = jax.tree_util.tree_map(
            lambda new, old: jnp.where(hold, old, new), after, before
        )
        after[4]["resume_skip"] = jnp.where(
            halted, entry["resume_skip"], jnp.maximum(entry["resume_skip"] - 1, 0)
        )
        return after

    # Pieces -------------------------------------------------------------------------

    def micro_batch_weight(self, x, y, sample_weight, normalizers):
        """`w_i`: 1 (uniform), the user's callable, the compiled loss's normalizer
        (exact), else the micro-batch's size."""
        weighting = self.options.weighting
        if weighting == "uniform":
            return jnp.asarray(1.0, "float32")
        if callable(weighting):
            return callable_weight(weighting, x, y, sample_weight)
        if not normalizers:
            # (A model's own step with a loss of its own is weighted by size, as
            # the contract says: nothing to warn about.)
            if not self.warned_no_compiled_loss and self.own_step is None:
                self.warned_no_compiled_loss = True
                _fit_common.warn_no_compiled_loss()
            first = next(t for t in keras.tree.flatten(x) if t is not None)
            return jnp.asarray(first.shape[0], "float32")
        return jnp.asarray(normalizers[0], "float32")

    def unscale(self, gradients, weight, accept, optimizer_variables):
        """Under a LossScaleOptimizer: the gradients unscaled (and weighed by
        `weight` unless it is None: one multiply for both), whether the micro-batch
        is accumulated (its gradients are finite, and a `nonfinite` callable keeps
        it), and the optimizer's variables with the scale's reaction: doubled after
        `dynamic_growth_steps` accepted micro-batches in a row, halved on a skip."""
        optimizer_variables = list(optimizer_variables)
        scale = optimizer_variables[self.scale_slot]
        counter = optimizer_variables[self.counter_slot]
        accepted = all_finite(gradients)
        if callable(self.options.nonfinite):
            accepted = accepted & accept
        if self.options.split:
            # Split mode: an overflow backs off at once; the finite steps that grow
            # the scale are counted once per batch, as Keras counts them (`grow`).
            optimizer_variables[self.counter_slot] = jnp.where(
                accepted, counter, jnp.zeros_like(counter)
            )
            optimizer_variables[self.scale_slot] = jnp.where(accepted, scale, scale * 0.5)
        else:
            grows = counter == self.model.optimizer.dynamic_growth_steps - 1
            optimizer_variables[self.counter_slot] = jnp.where(
                accepted & ~grows, counter + 1, jnp.zeros_like(counter)
            )
            optimizer_variables[self.scale_slot] = jnp.where(
                accepted, jnp.where(grows, scale * 2, scale), scale * 0.5
            )
        factor = 1.0 / scale.astype("float32")
        if weight is not None:
            factor = factor * weight.astype("float32")
        unscaled = [None if g is None else g * factor.astype(g.dtype) for g in gradients]
        return unscaled, accepted, optimizer_variables

    def grow(self, optimizer_variables, finite):
        """Split mode under a LossScaleOptimizer, at the end of a batch: one finite
        step of the scale's count (doubled after `dynamic_growth_steps` of them) when
        no micro-batch of the batch overflowed (`finite`)."""
        optimizer_variables = list(optimizer_variables)
        scale = optimizer_variables[self.scale_slot]
        counter = optimizer_variables[self.counter_slot]
        grows = counter == self.model.optimizer.dynamic_growth_steps - 1
        optimizer_variables[self.counter_slot] = jnp.where(
            finite, jnp.where(grows, jnp.zeros_like(counter), counter + 1), counter
        )
        optimizer_variables[self.scale_slot] = jnp.where(finite & grows, scale * 2, scale)
        return optimizer_variables

    def accepts(self, gradients):
        """Whether the micro-batch is accumulated under `nonfinite` (a boolean)."""
        nonfinite = self.options.nonfinite
        if nonfinite == "apply":
            return jnp.asarray(True)
        if callable(nonfinite):
            from gradaccum._validation import check_callable_result

            skip = check_callable_result(
                nonfinite(list(gradients)), "nonfinite",
                kind="a boolean (True: skip the micro-batch)",
                scalar="a scalar boolean", accepts=lambda dtype: dtype == "bool",
            )
            return ~skip
        return all_finite(gradients)

    def track_term_ratios(self, ours, normalizers):
        first = jnp.asarray(normalizers[0], "float32")
        safe = jnp.where(first == 0, 1.0, first)
        ratios = jnp.stack([
            jnp.where(first == 0, 0.0, jnp.asarray(n, "float32") / safe)
            for n in normalizers[1:]
        ])[: self.terms]
        previous = ours["term_ratios"]
        opening = (ours["micro_step"] + ours["window_skipped"]) == 0
        differs = jnp.any(jnp.abs(ratios - previous) > 1e-6 * jnp.abs(previous))
        ours["inexact"] = ours["inexact"] | (~opening & differs)
        ours["term_ratios"] = jnp.where(opening, ratios, previous)
        return ours

    def close(self, trainable, optimizer_variables, window, apply, close, appliers=None,
              direct=None):
        """The window after this micro-batch: applied with one update of each
        optimizer (`appliers`: the step's) when `apply`, reset when `close`.
        `direct`: the micro-batch's gradients, applied as they are (a window of one
        micro-batch that did not go through the accumulators)."""
        n = len(trainable)
        options = self.options
        appliers = self.appliers if appliers is None else appliers

        def update(operands):
            trainable, optimizer_variables, sums, total_weight = operands
            if direct is not None:
                gradients = [g.astype(dtype) for g, dtype in zip(sums, self.variable_dtypes)]
            else:
                if options.privacy is not None:
                    sums = privacy.noised(sums, options.privacy, self.noise_key,
                                          window["updates"])
                gradients = combine(sums, total_weight, options.reduction,
                                    self.variable_dtypes)
            trainable, optimizer_variables = list(trainable), list(optimizer_variables)
            for applier in appliers:
                optimizer, slots = applier.optimizer, applier.optimizer_slots
                if self.loss_scaled:
                    # Unscaled and finite already: the inner optimizer applies them.
                    optimizer = optimizer.inner_optimizer
                    slots = [slots[i] for i in self.inner_slots]
                places = applier.variable_slots
                new_variables, new_optimizer = optimizer.stateless_apply(
                    [optimizer_variables[i] for i in slots],
                    [None if p in applier.no_gradient else gradients[p] for p in places],
                    [trainable[p] for p in places],
                )
                for p, value in zip(places, new_variables):
                    trainable[p] = value
                for i, value in zip(slots, new_optimizer):
                    optimizer_variables[i] = value
            return trainable, optimizer_variables

        def keep(operands):
            trainable, optimizer_variables, _, _ = operands
            return list(trainable), list(optimizer_variables)

        if direct is not None:
            sums = [jnp.zeros(v.shape, v.dtype) if g is None else g
                    for g, v in zip(direct, trainable)]
        else:
            sums = [window[f"accumulator_{i}"] for i in range(n)]
        trainable, optimizer_variables = jax.lax.cond(
            apply, update, keep,
            (list(trainable), list(optimizer_variables), sums, window["total_weight"]),
        )
        window = dict(window)
        length = window["micro_step"] + window["window_skipped"]
        window["updates"] = window["updates"] + apply.astype("int32")
        window["last_window_micro_batches"] = jnp.where(
            apply, length, window["last_window_micro_batches"]
        )
        window["last_window_weight"] = jnp.where(
            apply, window["total_weight"], window["last_window_weight"]
        )
        if "largest_window" in window:
            window["largest_window"] = jnp.where(
                apply, jnp.maximum(window["largest_window"], window["total_weight"]),
                window["largest_window"],
            )
        for i, total in enumerate(sums if direct is None else []):
            window[f"accumulator_{i}"] = jnp.where(close, jnp.zeros_like(total), total)
        for field in ("total_weight", "micro_step", "window_skipped"):
            window[field] = jnp.where(close, jnp.zeros_like(window[field]), window[field])
        return trainable, optimizer_variables, window

    def stateless_metrics(self, metrics_variables, loss, weight, compute):
        """Runs `compute` (the compiled metrics' update, or reading them) on the
        metric variables given, after adding `loss` with `weight` to the loss
        tracker (unless `loss` is None), as Keras's step does. Returns its result
        and the updated metric variables."""
        model = self.model
        mapping = list(zip(model.metrics_variables, metrics_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            if loss is not None:
                kc.loss_tracker(model).update_state(loss, sample_weight=weight)
            logs = compute()
        updated = []
        for ref, value in zip(model.metrics_variables, metrics_variables):
            new = scope.get_current_value(ref)
            updated.append(value if new is None else new)
        return logs, updated

    def counters(self, optimizer_variables, ours) -> dict:
        """`updates`, `window_micro_batches`, `window_weight`, `skipped` and the
        step's error for the hook, read in the jitted step."""
        logs = {
            "updates": optimizer_variables[self.appliers[0].iterations_slot()].astype(
                "float32"
            ),
            "window_micro_batches": ours["last_window_micro_batches"].astype("float32"),
            "window_weight": ours["last_window_weight"].astype("float32"),
        }
        if self.options.nonfinite != "apply" or self.loss_scaled:
            logs["skipped"] = ours["skipped"].astype("float32")
        if self.raises:
            logs[ERROR_KEY] = ours["error"]
        return logs

    @property
    def raises(self) -> bool:
        """Whether the step can find an error that `fit` raises after it."""
        options = self.options
        return (options.nonfinite == "raise" or callable(options.weighting)
                or callable(options.window.steps))

    def close_eagerly(self, apply: bool):
        """A function of the model's variables that closes the open window (applies
        it when `apply` and it holds an accepted micro-batch): the end of the data,
        outside the step."""
        model = self.model
        if not self.appliers_known:
            open_micro_batches = int(self.state.micro_step.numpy())
            if open_micro_batches:
                warnings.warn(
                    f"gradaccum cannot apply the open window ({open_micro_batches} "
                    f"micro-batches) of {type(model).__name__} here: which optimizers "
                    "apply a model's own `train_step` is read from the step when it "
                    "first runs in this process, and it has not run since the window "
                    "was restored. The window is left unapplied (kept while the "
                    "model accumulates; `gradaccum.disable` drops it).",
                    stacklevel=4,
                )
            return False
        trainable = [v.value for v in model.trainable_variables]
        # Each optimizer's own variables in turn (the state the trainer carried
        # them in is the model's business).
        carried, appliers = [], []
        for applier in self.appliers:
            appliers.append(applier.renumbered(len(carried)))
            carried += list(applier.optimizer.variables)
        optimizer_variables = [v.value for v in carried]
        ours = self.state.carried()
        window = self.state.unpack({name: v.value for name, v in ours.items()})
        has = window["micro_step"] > 0
        applied = jnp.asarray(apply) & has
        close = functools.partial(self.close, appliers=appliers)
        trainable, optimizer_variables, window = jax.jit(close)(
            trainable, optimizer_variables, window, applied, jnp.asarray(True)
        )
        for v, value in zip(model.trainable_variables, trainable):
            v.assign(value)
        for v, value in zip(carried, optimizer_variables):
            v.assign(value)
        for name, value in self.state.pack(window).items():
            ours[name].assign(value)
        return bool(applied)

    @property
    def primary_optimizer(self):
        """The optimizer whose updates `updates` counts: the model's, or the first
        its own step hands gradients to (a GAN's first)."""
        return self.appliers[0].optimizer


# The log entry that carries the step's error to fit's hook (which removes it).
ERROR_KEY = "_gradaccum_error"
# The fields that record an error (kept when a split batch's error undoes it).
ERROR_FIELDS = ("error", "error_at", "error_micro_batch", "micro_batches")


def batch_size(data) -> int:
    """The (static) number of samples in a batch to split: the first dimension its
    arrays agree on."""
    leaves = jax.tree_util.tree_leaves(data)
    if not leaves or any(len(t.shape) == 0 for t in leaves):
        raise ValueError(
            "A batch to split into micro-batches must hold arrays with a batch "
            f"dimension. Received: arrays of shapes {[tuple(t.shape) for t in leaves]}"
        )
    check_batch_dimensions([t.shape[0] for t in leaves], [t.shape for t in leaves])
    return int(leaves[0].shape[0])


def kept_unless_accepted(new, old, before, after):
    """The non-trainable variables after a micro-batch (statistics, seeds), or as
    they were where it was not accumulated (skipped: it never reaches the
    weights)."""
    accepted = after["micro_step"] > before["micro_step"]
    return [jnp.where(accepted, n, o) for n, o in zip(new, old)]


class Shards:
    """How a batch is laid out across devices (keras.distribution shards its first
    dimension over the mesh axis of the data), and the micro-batches cut from it so
    that no sample moves: micro-batch j is the j-th run of `size / count` samples
    of every shard, side by side. Without a distribution there is one shard and the
    micro-batches are consecutive. Exact weighting makes an update independent of
    which samples share a micro-batch.

    Args:
        count: the number of shards of the batch.
        axis: the mesh axis (or axes) the batch is sharded over, None for one shard.
        mesh: the JAX mesh, None for one shard.
    """

    def __init__(self, count=1, axis=None, mesh=None):
        self.count, self.axis, self.mesh = count, axis, mesh

    @classmethod
    def of_batch(cls, size=None) -> Shards:
        """The shards of the current distribution's batches; a micro-batch `size`
        must split evenly over them."""
        distribution = keras.distribution.distribution()
        if distribution is None:
            return cls()
        layout = distribution.get_data_layout((1,))
        axis = layout.axes[0]
        if axis is None:
            return cls()
        mesh = layout.device_mesh
        sizes = dict(zip(mesh.axis_names, mesh.shape))
        count = 1
        for name in (axis,) if isinstance(axis, str) else tuple(axis):
            count *= sizes[name]
        if size is not None and size % count:
            raise ValueError(
                "`micro_batch_size` must be a multiple of the number of devices the "
                "batch is sharded over, so that each micro-batch takes an equal part "
                f"of every shard. Received: micro_batch_size={size} with batches "
                f"sharded over {count} devices (mesh axis {axis!r} of "
                f"{type(distribution).__name__})"
            )
        return cls(count, axis, mesh.backend_mesh)

    def cut(self, data, whole: int, part: int, rest: int):
        """The batch as `whole` micro-batches of `part` samples per shard, stacked
        on a new first dimension, and the shorter last one of `rest` samples per
        shard (None where there is none)."""
        count = self.count

        def shards(t):
            return t.reshape((count, t.shape[0] // count) + tuple(t.shape[1:]))

        def stacked(t):
            sample = tuple(t.shape[1:])
            body = shards(t)[:, : whole * part].reshape((count, whole, part) + sample)
            body = jnp.moveaxis(body, 0, 1).reshape((whole, count * part) + sample)
            return self.constrain(body, 1)

        def tail(t):
            last = shards(t)[:, whole * part:]
            return self.constrain(last.reshape((count * rest,) + tuple(t.shape[1:])), 0)

        body = jax.tree_util.tree_map(stacked, data) if whole else None
        last = jax.tree_util.tree_map(tail, data) if rest else None
        return body, last

    def constrain(self, array, dimension: int):
        """`array` sharded over the data's axis on `dimension` (the samples)."""
        if self.mesh is None:
            return array
        spec = [None] * array.ndim
        spec[dimension] = self.axis
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))
        return jax.lax.with_sharding_constraint(array, sharding)
