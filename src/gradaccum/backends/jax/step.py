"""The training step on JAX: how gradients are computed, around the state machine.

`TrainStep(model, options, state)` is the model's `train_step(state, data)` while
gradaccum accumulates for it: a pure function of the trainer's state, jitted with it.
What a micro-batch does to its window (open, screen, admit, decide, close) is
`gradaccum.core.transitions`; this module computes what they take:

- Keras's default step: the model's own loss (`compute_loss_and_updates`: the
  forward pass, `compute_loss`, the compiled loss and regularizers), differentiated
  weighted by the micro-batch's weight (or scaled, under a `LossScaleOptimizer`);
- a model's own `train_step(state, data)` runs as written: what it hands to each
  optimizer's `stateless_apply` goes through that optimizer's window in the call
  itself (`own_step.py`), so a window that is due is applied where the step applies;
- split mode (`micro_batch_size`): the batch cut into micro-batches inside the step
  (a `lax.scan`), laid out across a keras.distribution's data shards, applied once
  (`split_step.py`);
- DP-SGD (`gradaccum.Privacy`): each example's gradient clipped (`privacy.py`).

The records live in a `record.Carry` while the step traces; the state goes back
into the trainer's metric variables packed (`state.AccumulationState`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras

from gradaccum import _keras_common as kc
from gradaccum.backends.jax import device_sums, privacy, split_step
from gradaccum.backends.jax import own_step as _own_step
from gradaccum.backends.jax.own_step import Applier
from gradaccum.backends.jax.record import (
    Carry,
    FitRecord,
    LossScaling,
    WindowRecord,
    where_accepted,
)
from gradaccum.backends.jax.state import AccumulationState, window_prefix
from gradaccum.core import fit_logs, overwrite
from gradaccum.core import transitions as tr
from gradaccum.core.moving_statistics import Follower

# The log entry that carries the step's error to fit's hook (which removes it).
ERROR_KEY = "_gradaccum_error"


class TrainStep:
    """The stateless training step of a model gradaccum accumulates for on JAX.

    Args:
        model: the user's model.
        options: the checked `Options`.
        state: the model's `AccumulationState`.
        normalizers: the `NormalizerLog` the compiled losses record `n_i` into.
        own_step: the model's own `train_step(state, data)`, or None (Keras's).
    """

    def __init__(self, model, options, state: AccumulationState, normalizers,
                 own_step=None, follower=None):
        self.model = model
        self.own_step = own_step
        self.options = options
        self.policy = options.policy()
        self.state = state
        self.normalizers = normalizers
        self.warned_no_compiled_loss = False
        metrics_variables = model.metrics_variables
        fields = {id(v): name for name, v in state.carried().items()}
        # Where the state's variables sit among the trainer's metric variables.
        self.slots = {fields[id(v)]: i for i, v in enumerate(metrics_variables) if id(v) in fields}
        if len(self.slots) != len(fields):
            raise ValueError(
                "gradaccum's state rides in the metric variables Keras's JAX trainer "
                "carries (`model.metrics_variables`, from `model.metrics`). Received: "
                f"model {model.name!r} of class {type(model).__name__} whose `metrics` "
                "leaves out the metrics it tracks; return "
                "`super().metrics + [...]` (or list your metrics in `compile`)."
            )
        optimizer = model.optimizer
        # Window record j belongs to the model's optimizer j (`named_optimizers`):
        # Keras's default step applies the model's optimizer (record 0) to all the
        # state; a model's own step hands its gradients to optimizers of its own,
        # read from the step as it is traced (`appliers`, by record).
        self.optimizers = [o for _, o in kc.named_optimizers(model)][: state.records]
        self.appliers = {0: Applier.whole(optimizer, len(model.trainable_variables))}
        self.appliers_known = own_step is None
        self.variable_dtypes = [v.dtype for v in model.trainable_variables]
        self.overwrites, self.measured = overwrite.kinds(model.trainable_variables)
        # A LossScaleOptimizer: where its step counter, scale and inner optimizer's
        # variables sit among its variables.
        scaling = LossScaling(optimizer)
        self.loss_scaled = scaling.loss_scaled
        if self.loss_scaled:
            self.counter_slot, self.scale_slot = scaling.counter_slot, scaling.scale_slot
            self.inner_slots = scaling.inner_slots
            self.growth_steps = scaling.growth_steps
        # A window of one micro-batch (steps=1) in Keras's step: the micro-batch's
        # gradient is the window's, applied without passing through the accumulators
        # (as TensorFlow's step does): no pass to add it, none to read and reset it.
        # (Not with the noise scale under a distribution, whose pieces are the
        # devices' shares.)
        self.direct = (own_step is None and not options.split and not self.loss_scaled
                       and options.window.constant == 1 and options.privacy is None
                       and not (options.noise_scale and state.rows is not None))
        # DP-SGD: the root key of the window's noise (`privacy.noised`).
        self.privacy = options.privacy
        self.noise_key = None
        if options.privacy is not None:
            self.noise_key = privacy.noise_key(options.privacy.noise_seed())
        # Under a keras.distribution's batch axis, the sums' rows (one per device,
        # `device_sums`), or None; where the model's seed states sit (each device
        # draws from its own).
        self.rows = state.rows
        self.seed_slots = device_sums.seed_slots(model) if self.rows is not None else []
        self.rows_fallback = False
        # The noise scale's pieces of the micro-batch being traced, where the step
        # cut it per device (`device_sums.gradients`), else None.
        self.noise_pieces = None
        # Whether the fit can restore inside an epoch (BackupAndRestore): only then
        # does the step carry the branch that skips micro-batches trained on.
        self.resumable = False
        # Keras's BatchNormalization layers followed through the window: where their
        # moving (mean, variance) sit among the non-trainable variables.
        self.follower = follower if follower is not None else Follower([])
        place = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self.moving_slots = [(place[id(mean)], place[id(variance)])
                             for mean, variance in self.follower.moving()]

    def record(self, carry: Carry, index: int = 0, applier=None) -> WindowRecord:
        """Window record `index` in `carry`, applied by `applier` (the record's)."""
        applier = self.appliers[index] if applier is None else applier
        return WindowRecord(carry, self, applier, window_prefix(index))

    # The step ---------------------------------------------------------------------

    def __call__(self, state, data, micro_batch_size=None, closes=True):
        """One batch: a micro-batch (`steps` mode), or in split mode the window cut
        into micro-batches of `micro_batch_size` (the option's unless given: the
        size `"auto"` tries). `closes=False`: a micro-batch of Keras's step that the
        host knows closes no window (`phases.py`), compiled without the close."""
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        fields = self.state.unpack({name: metrics_variables[i]
                                  for name, i in self.slots.items()})
        carry = Carry(trainable, non_trainable, optimizer_variables, metrics_variables, fields)
        entry = Carry(trainable, non_trainable, optimizer_variables, metrics_variables, fields)
        if self.options.split:
            size = micro_batch_size or self.options.micro_batch_size
            logs = split_step.split_batch(self, carry, data, size)
        elif self.own_step is not None:
            logs = _own_step.run(self, carry, data)
        else:
            logs = self.micro_batch(carry, data, closes)
        logs = dict(logs, **self.counters(carry))
        self.pass_over_restored(carry, entry)
        metrics_variables = list(carry.metrics)
        for name, value in self.state.pack(carry.fields).items():
            metrics_variables[self.slots[name]] = value
        return logs, (carry.trainable, carry.non_trainable, carry.optimizer,
                      metrics_variables)

    def micro_batch(self, carry: Carry, data, closes=True):
        """`steps` mode with Keras's step: the batch is one micro-batch of the open
        window, which it may close (unless `closes` is False)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        fit = FitRecord(carry)
        fit.add("epoch_step", 1)
        record = self.record(carry)
        entry_metrics = list(carry.metrics)
        loss, y_pred, weight, gradients, normalizers, weighted, unit = self.gradients(
            carry, record, x, y, sample_weight
        )
        tr.track_terms(fit, record, normalizers)
        before = carry.non_trainable
        carry.non_trainable = list(self.forward_state)
        end = tr.end_of_data(fit)
        accepted = tr.micro_batch(
            self.policy, record, gradients, weight, weighted=weighted,
            loss_scale=self.growth_steps if self.loss_scaled else None,
            end=end, fit=fit, direct=self.direct, unit=unit, closes=closes,
            samples=tr.samples(x), pieces=self.noise_pieces,
        )
        if not closes:
            tr.unclosed(self.policy, record, end)
        carry.non_trainable = where_accepted(accepted, carry.non_trainable, before)
        self.follow(carry, before, self.forward_state, record.outcome)
        logs, carry.metrics = self.stateless_metrics(
            self.forward_metrics, loss, fit_logs.logged_weight(self.policy, x, weight),
            lambda: self.model.compute_metrics(x, y, y_pred, sample_weight),
        )
        if fit_logs.tracks_skips(self.policy, self.loss_scaled):
            # A skipped micro-batch leaves the loss tracker and the metrics: the
            # logs (History, callbacks such as TerminateOnNaN) are the used ones'.
            carry.metrics = where_accepted(accepted, carry.metrics, entry_metrics)
            logs, _ = self.stateless_metrics(carry.metrics, None, None,
                                             self.model.get_metrics_result)
        return logs

    def gradients(self, carry: Carry, record, x, y, sample_weight, length=None):
        """One micro-batch's loss and gradients through the model's own loss
        computation. Returns the unscaled loss, the predictions, the micro-batch's
        weight, the gradients, the normalizers the compiled loss recorded and
        whether the gradients carry the weight (the loss was weighted); leaves the
        forward pass's non-trainable and metric variables in `forward_state` and
        `forward_metrics`. `length`: the window's length in micro-batches of this
        one's size, where the caller knows it (split mode)."""
        model = self.model
        policy = self.policy
        if self.options.privacy is not None:
            return self.private_gradients(carry, x, y, sample_weight)
        # A weight that needs no loss is known before it (and its errors recorded
        # outside the differentiated function).
        known = None
        if policy.weighting != "exact":
            known = tr.weigh(policy, x, y, sample_weight, [], record)
        # Under loss scaling the weight comes with the unscaling instead, so that
        # the scaled loss is the one Keras scales (no extra overflows).
        weighted = policy.mean and not self.loss_scaled and not self.direct
        optimizer_variables = carry.optimizer
        # Each device's share is a piece of the noise scale's (`device_sums`).
        self.noise_pieces = None
        if self.rows is not None and not self.rows_fallback:
            try:
                with self.follower.observing():
                    return device_sums.gradients(self, carry, x, y, sample_weight,
                                                 weighted)
            except device_sums.Unsupported as why:
                # Reduced per micro-batch, as before, into the sums' first row.
                self.rows_fallback = True
                device_sums.warn(self.rows.described, str(why),
                                 sharded=self.options.sums == "sharded")

        def objective(trainable, non_trainable, metrics_variables):
            self.normalizers.take()
            loss, aux = model.compute_loss_and_updates(
                trainable, non_trainable, metrics_variables, x, y, sample_weight,
                training=True, optimizer_variables=optimizer_variables,
            )
            normalizers = self.normalizers.take()
            weight = known
            if weight is None:
                weight = tr.weigh(policy, x, y, sample_weight, normalizers, record,
                                  warn=self._warn_once())
            weight = jax.lax.stop_gradient(weight)
            factor, unit = tr.loss_factor(policy, record, weight, weighted=weighted,
                                          direct=self.direct, length=length,
                                          fit=FitRecord(carry))
            value = loss if factor is None else loss * factor.astype(loss.dtype)
            return value, (aux, weight, normalizers, unit)

        with self.follower.observing():
            (_, (aux, weight, normalizers, unit)), gradients = jax.value_and_grad(
                objective, has_aux=True
            )(carry.trainable, carry.non_trainable, carry.metrics)
        unscaled_loss, y_pred, self.forward_state, self.forward_metrics = aux
        if self.rows is not None:
            gradients = [None if g is None else self.rows.from_whole(i, g)
                         for i, g in enumerate(gradients)]
        return unscaled_loss, y_pred, weight, gradients, normalizers, weighted, unit

    def _warn_once(self) -> bool:
        """Whether to warn that exact weighting found no compiled loss (once per
        step)."""
        if self.warned_no_compiled_loss:
            return False
        self.warned_no_compiled_loss = True
        return True

    def private_gradients(self, carry: Carry, x, y, sample_weight):
        """`gradients` with `gradaccum.Privacy`: the sum of the examples' clipped
        gradients, weighted by the number of examples (the window's noise is added
        when it is applied). The loss is the micro-batch's, as Keras computes it."""
        model = self.model
        gradients, weight, y_pred, self.forward_state = privacy.clipped_micro_batch(
            model, self.options.privacy, carry.trainable, carry.non_trainable, x, y,
            sample_weight,
        )
        loss, (_, _, self.forward_metrics) = model.stateless_compute_loss(
            carry.trainable, self.forward_state, carry.metrics, x=x, y=y, y_pred=y_pred,
            sample_weight=sample_weight, training=True,
        )
        return loss, y_pred, weight, gradients, None, True, None

    def pass_over_restored(self, carry: Carry, entry: Carry) -> None:
        """The step's result, or the state it found where the batch changes nothing
        but the epoch's position: a restored run's batch already trained on
        (BackupAndRestore inside an epoch), or after an error (the rest of a
        compiled call of several batches, before fit raises: nothing at all)."""
        if not self.passes_over_restored:
            return
        fields = entry.fields
        halted = fields["error"] > 0
        hold = (fields["resume_skip"] > 0) | halted
        epoch_step = jnp.where(halted, fields["epoch_step"], carry.fields["epoch_step"])
        resume_skip = jnp.where(halted, fields["resume_skip"],
                                jnp.maximum(fields["resume_skip"] - 1, 0))
        after = (carry.trainable, carry.non_trainable, carry.optimizer, carry.metrics,
                 carry.fields)
        before = (entry.trainable, entry.non_trainable, entry.optimizer, entry.metrics,
                  fields)
        (carry.trainable, carry.non_trainable, carry.optimizer, carry.metrics,
         carry.fields) = jax.tree_util.tree_map(
            lambda new, old: jnp.where(hold, old, new), after, before
        )
        carry.fields["epoch_step"] = epoch_step
        carry.fields["resume_skip"] = resume_skip

    @property
    def passes_over_restored(self) -> bool:
        """Whether the step passes over the micro-batches a restored run trained on
        already (`resume_skip`): compiled in only where the fit can restore inside an
        epoch, or where an error halts the step (`pass_over_restored`)."""
        return self.resumable or self.policy.raises

    # Pieces -------------------------------------------------------------------------

    def follow(self, carry: Carry, start, moved, outcome) -> None:
        """The followed layers after a micro-batch (`moved`: the non-trainable
        variables its forward pass left; None: a window closed outside one), from
        `start` (those before it): `core.moving_statistics`."""
        follower = self.follower
        if not follower:
            return
        slots = self.moving_slots
        statistics, values = follower.step(
            {name: carry.fields[name] for name in follower.names()},
            [(start[a], start[b]) for a, b in slots],
            None if moved is None else [(moved[a], moved[b]) for a, b in slots],
            *outcome,
        )
        carry.fields.update(statistics)
        for (a, b), (mean, variance) in zip(slots, values):
            carry.non_trainable[a] = mean
            carry.non_trainable[b] = variance

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

    def counters(self, carry: Carry) -> dict:
        """`updates`, `window_micro_batches`, `window_weight`, `skipped` and the
        step's error for the hook, read in the jitted step: the window of the
        optimizer `updates` counts (the first record with an applier)."""
        index = self.primary_index
        applier = self.appliers[index]
        record = self.record(carry, index, applier)
        skipped = None
        if fit_logs.skips_possible(self.policy, self.loss_scaled):
            # Every optimizer's window saw the same micro-batches: the one that
            # skipped most counts.
            counts = [self.record(carry, j).get("skipped") for j in self.appliers]
            skipped = counts[0] if len(counts) == 1 else jnp.max(jnp.stack(counts))
        logs = fit_logs.counters(record, carry.optimizer[applier.iterations_slot()], skipped)
        if self.policy.raises:
            logs[ERROR_KEY] = carry.fields["error"]
        return logs

    @property
    def primary_index(self) -> int:
        """The record of the optimizer whose updates `updates` counts: the model's,
        or the first its own step hands gradients to (a GAN's first)."""
        return min(self.appliers)

    @property
    def primary_optimizer(self):
        return self.appliers[self.primary_index].optimizer
