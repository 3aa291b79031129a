"""The training step on PyTorch: how gradients are computed, around the state machine.

`TrainStep(accumulation)` is the model's `train_step(data)` while gradaccum
accumulates for it, in Keras's torch pattern (the forward pass, `compute_loss`,
`loss.backward()`, the parameters' `.grad`). What a micro-batch does to its window
(open, screen, admit, decide, close) is `gradaccum.core.transitions`; this module
computes what they take:

- Keras's default step: the model's own loss (the compiled loss recording its
  normalizers), differentiated weighted by the micro-batch's weight (or scaled,
  under a `LossScaleOptimizer`);
- a model's own `train_step` runs as written, each optimizer call through its
  window (`own_step.py`);
- split mode (`micro_batch_size`): the batch cut into micro-batches, each
  differentiated and admitted, the window applied once; `"auto"` halves the size
  after torch's out-of-memory error;
- DP-SGD (`gradaccum.Privacy`): each example's gradient clipped (`privacy.py`).

A micro-batch skipped for a non-finite gradient leaves the model as it found it:
the metrics, and the non-trainable variables its forward pass moved.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import keras
import torch

from gradaccum import _keras_common as kc
from gradaccum.backends.torch import own_step as _own_step
from gradaccum.backends.torch.record import (
    FieldRecord,
    WindowRecord,
    eager,
    restore,
    snapshot,
    tensor,
    truth,
)
from gradaccum.backends.torch.state import window_prefix
from gradaccum.core import fit_logs, loss_scaling
from gradaccum.core import transitions as tr
from gradaccum.core.state import LARGEST_KEPT
from gradaccum.core.validation import split_batch_size as batch_size

# What torch's allocators say when memory runs out (CUDA's error is
# torch.OutOfMemoryError; the CPU allocator raises a RuntimeError).
OUT_OF_MEMORY = ("out of memory", "can't allocate memory")


# The state machine's transitions the step calls, run eagerly.
micro_batch_transitions = eager(tr.micro_batch)
apply_now = eager(tr.apply_now)
drop = eager(tr.drop)
track_terms = eager(tr.track_terms)
weigh = eager(tr.weigh)
loss_factor = eager(tr.loss_factor)


class ForwardState:
    """The non-trainable variables a micro-batch's forward pass may move (batch
    normalization's statistics, counters, a seed generator's state), put back where
    the micro-batch is skipped. Those larger than `core.state.LARGEST_KEPT` elements
    are taken as frozen weights (a LoRA base model's kernels) and not copied before
    each micro-batch: one that a skipped micro-batch moved all the same is named in
    a warning (it cannot be put back).

    Args:
        model: the model (its non-trainable variables are read again where their
            number changed: a subclassed model builds in its first step).
    """

    def __init__(self, model):
        self.model = model
        self.count = None
        self.small, self.large = [], []
        self.warned = False

    def take(self):
        """What `put_back` needs: the small ones' values, the large ones' versions."""
        variables = self.model.non_trainable_variables
        if len(variables) != self.count:
            self.count = len(variables)
            self.small = [v for v in variables if math.prod(v.shape) <= LARGEST_KEPT]
            self.large = [v for v in variables if math.prod(v.shape) > LARGEST_KEPT]
        return self.small, snapshot(self.small), [v.value._version for v in self.large]

    def put_back(self, taken) -> None:
        small, values, versions = taken
        restore(small, values)
        moved = [v for v, version in zip(self.large, versions) if v.value._version != version]
        if moved and not self.warned:
            self.warned = True
            names = ", ".join(f"{v.path!r} ({math.prod(v.shape)} values)" for v in moved)
            warnings.warn(
                f"gradaccum skipped a micro-batch whose forward pass moved the "
                f"non-trainable variable(s) {names}: variables of more than "
                f"{LARGEST_KEPT} values are taken as frozen weights and not copied "
                "before each micro-batch, so that move stays.",
                stacklevel=4,
            )


def clear_gradients(model, variables) -> None:
    """Empties `.grad` before a backward pass: the module's parameters (Keras's
    `zero_grad`) and each trained variable's tensor itself. A variable whose tensor
    Keras replaced after the model tracked it (LoRA enabled after building, a
    KerasHub task's weights set) is not among the module's parameters, and
    `zero_grad` would leave its last gradient to add up with the next."""
    model.zero_grad()
    for variable in variables:
        variable.value.grad = None


def is_out_of_memory(error) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(w in str(error) for w in OUT_OF_MEMORY))


class TrainStep:
    """The training step of a model gradaccum accumulates for on PyTorch.

    Args:
        accumulation: the model's `fit.Accumulation` (its host, options, state).
    """

    def __init__(self, accumulation):
        self.accumulation = accumulation
        self.model = accumulation.host
        self.options = accumulation.options
        self.policy = accumulation.policy
        self.state = accumulation.state
        self.normalizers = accumulation.normalizers
        self.follower = accumulation.follower
        model = self.model
        self.variables = list(model.trainable_variables)
        # Each trained variable's place (its sum's) by identity.
        self.place = {id(v): i for i, v in enumerate(self.variables)}
        self.forward_state = ForwardState(model)
        self.loss_scaled = kc.is_loss_scale_optimizer(model.optimizer)
        self.growth_steps = (int(model.optimizer.dynamic_growth_steps)
                             if self.loss_scaled else None)
        # A window of one micro-batch in Keras's step: its gradients go to the
        # update as they are (no pass through the sums).
        self.direct = (accumulation.own_train_step is None and not self.options.split
                       and not self.loss_scaled and self.options.window.constant == 1
                       and self.options.privacy is None)
        self.warned_no_compiled_loss = False
        # A model's own step: the optimizers it applies that are not routed.
        self.unrouted = kc.UnroutedUpdates()
        # A model's own step: the window record of each optimizer it applies, by
        # the optimizer's place among the model's (`kc.named_optimizers`).
        self.appliers = {}

    # Records ----------------------------------------------------------------------

    def fit_record(self) -> FieldRecord:
        return FieldRecord(self.state)

    def record(self, index: int = 0, optimizer=None, variables=None) -> WindowRecord:
        """Window record `index`, applied by `optimizer` to `variables` (the
        model's optimizer and trainable variables by default)."""
        optimizer = self.model.optimizer if optimizer is None else optimizer
        slots: Sequence[int]
        if variables is None:
            variables, slots = self.variables, range(len(self.variables))
        else:
            variables = list(variables)
            slots = [self.place[id(v)] for v in variables]
        return WindowRecord(self.state, index, optimizer, variables, slots,
                            noise=self.accumulation.noise())

    # The step ---------------------------------------------------------------------

    @eager(recursive=False)
    def __call__(self, data):
        fit = self.fit_record()
        if self.accumulation.resumable and truth(fit.get("resume_skip") > 0):
            # Restored inside an epoch (BackupAndRestore): a batch trained on
            # before the restore moves nothing but the epoch's position.
            fit.add("resume_skip", -1)
            fit.add("epoch_step", 1)
            return dict(self.model.get_metrics_result(), **self.counters())
        if self.options.split:
            logs = self.split_batch(data)
        elif self.accumulation.own_train_step is not None:
            logs = _own_step.run(self, data)
        else:
            logs = self.micro_batch(data)
        return dict(logs, **self.counters())

    @eager(recursive=False)
    def micro_batch(self, data):
        """`steps` mode with Keras's step: the batch is one micro-batch of the open
        window, which it may close."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        fit = self.fit_record()
        fit.add("epoch_step", 1)
        record = self.record()
        model = self.model
        tracks = fit_logs.tracks_skips(self.policy, self.loss_scaled)
        # (The compiled loss updates its per-output trackers, and a layer may update
        # a metric in its call, before the screen: put back if it skips.)
        entry_metrics = snapshot(model.metrics_variables) if tracks else None
        entry_state = self.forward_state.take() if tracks else None
        start = self.moving_start()
        loss, y_pred, weight, gradients, normalizers, weighted, unit = self.gradients(
            record, x, y, sample_weight)
        track_terms(fit, record, normalizers)
        with torch.no_grad():
            accepted = micro_batch_transitions(
                self.policy, record, gradients, weight, weighted=weighted,
                loss_scale=self.growth_steps, end=tr.end_of_data(fit), fit=fit,
                direct=self.direct, unit=unit, samples=tr.samples(x),
            )
        accepted = truth(accepted)
        if not accepted and entry_state is not None:
            self.forward_state.put_back(entry_state)
        self.follow(start, record.outcome)
        if tracks and not accepted:
            # A skipped micro-batch leaves the loss tracker and the metrics: the
            # logs (History, TerminateOnNaN) are the used micro-batches'.
            restore(model.metrics_variables, entry_metrics)
            return model.get_metrics_result()
        kc.loss_tracker(model).update_state(
            loss.detach(), sample_weight=fit_logs.logged_weight(self.policy, x, weight))
        return model.compute_metrics(x, y, y_pred, sample_weight)

    @eager(recursive=False)
    def gradients(self, record, x, y, sample_weight, length=None):
        """One micro-batch's loss and gradients through the model's own loss
        computation (`loss.backward()` into the parameters' `.grad`). Returns the
        unscaled loss, the predictions, the micro-batch's weight, the gradients, the
        normalizers the compiled loss recorded and whether the gradients carry the
        weight."""
        model = self.model
        policy = self.policy
        if self.options.privacy is not None:
            from gradaccum.backends.torch import privacy

            return privacy.clipped_micro_batch(self, x, y, sample_weight)
        known = None
        if policy.weighting != "exact":
            known = weigh(policy, x, y, sample_weight, [], record)
        with self.follower.observing():
            if kc.call_has_training_arg(model):
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
        clear_gradients(model, self.variables)
        self.normalizers.take()
        loss = kc.compute_loss(model, x, y, y_pred, sample_weight)
        normalizers = [n.detach() if isinstance(n, torch.Tensor) else n
                       for n in self.normalizers.take()]
        weight = known
        if weight is None:
            weight = weigh(policy, x, y, sample_weight, normalizers, record,
                              warn=self._warn_once())
        weight = tensor(weight).detach().float()
        # Under loss scaling the weight comes with the unscaling instead, so the
        # scaled loss is the one Keras scales (no extra overflows).
        weighted = policy.mean and not self.loss_scaled and not self.direct
        # (With float8 layers, the loss the large batch differentiates: the gradient
        # float8 measures and quantizes is the large batch's.)
        factor, unit = loss_factor(policy, record, weight, weighted=weighted,
                                   direct=self.direct, length=length, fit=self.fit_record())
        objective = loss if factor is None else loss * tensor(factor).detach().to(loss.dtype)
        # Loss scaling (a LossScaleOptimizer's dynamic scale, or an optimizer's
        # static `loss_scale_factor`, which `apply` divides back out), as Keras's own
        # train step does.
        objective = model.optimizer.scale_loss(objective)
        objective.backward()
        gradients = [v.value.grad for v in self.variables]
        return loss, y_pred, weight, gradients, normalizers, weighted, unit

    def _warn_once(self) -> bool:
        if self.warned_no_compiled_loss:
            return False
        self.warned_no_compiled_loss = True
        return True

    # Split mode --------------------------------------------------------------------

    def split_batch(self, data):
        """Split mode: the batch is the window, cut into micro-batches (of the
        option's size, or the size `"auto"` tries, smaller after running out of
        memory), each admitted, the window applied once."""
        search = self.accumulation.auto_size
        batch = batch_size(data)
        if search is None:
            try:
                return self.split_run(data, batch, self.options.micro_batch_size)
            except BaseException:
                # A batch that raised (nonfinite="raise", an interrupt) leaves no
                # half-filled window behind: the next batch's starts empty.
                with torch.no_grad():
                    drop(self.record())
                raise
        model = self.model
        # What a try changes before its update: the state's fields, the metrics, the
        # non-trainable variables and a LossScaleOptimizer's scale (an overflowing
        # micro-batch backs it off). Not the sums: a split batch is its window, so
        # they are empty when it starts, and a failed try empties them again (no
        # copy of the model's size per batch).
        sums = {id(v) for v in self.state.accumulators}
        kept = [v for v in self.state.variables.values() if id(v) not in sums]
        if self.loss_scaled:
            kept += [model.optimizer.step_counter, model.optimizer.dynamic_scale]
        entry = (snapshot(kept), snapshot(model.metrics_variables),
                 self.forward_state.take())
        while True:
            size = min(search.size_for(batch), batch)
            self.applying = False
            try:
                logs = self.split_run(data, batch, size)
            except BaseException as error:
                # Nothing of the failed try is kept: the window starts again (and a
                # batch that raised leaves no half-filled window behind).
                restore(kept, entry[0])
                self.record().empty_sums()
                restore(model.metrics_variables, entry[1])
                self.forward_state.put_back(entry[2])
                clear_gradients(model, self.variables)
                if not is_out_of_memory(error):
                    raise
                if self.applying:
                    error.add_note(
                        "gradaccum: micro_batch_size='auto' cannot retry this batch: "
                        "memory ran out while the optimizer applied the update, "
                        "which a smaller micro-batch does not change.")
                    raise
                if size <= 1:
                    error.add_note("gradaccum: micro_batch_size='auto' ran out of memory "
                                   "with micro-batches of 1 sample.")
                    raise
                search.failed(size)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            search.ran(size)
            self.accumulation.size_chosen()
            return dict(logs, micro_batch_size=float(search.chosen))

    @eager(recursive=False)
    def split_run(self, data, batch: int, size: int):
        model = self.model
        fit = self.fit_record()
        record = self.record()
        tracks = fit_logs.tracks_skips(self.policy, self.loss_scaled)
        skipped_before = int(record.get("skipped"))
        weighted_loss, weights = 0.0, 0.0
        for start in range(0, batch, size):
            micro = keras.tree.map_structure(
                lambda t, s=start: None if t is None else t[s:s + size], data)
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(micro)
            entry_metrics = snapshot(model.metrics_variables) if tracks else None
            entry_state = self.forward_state.take() if tracks else None
            moving = self.moving_start()
            loss, y_pred, weight, gradients, normalizers, weighted, unit = self.gradients(
                record, x, y, sample_weight, length=batch / size)
            track_terms(fit, record, normalizers)
            with torch.no_grad():
                accepted = truth(micro_batch_transitions(
                    self.policy, record, gradients, weight, weighted=weighted,
                    loss_scale=self.growth_steps, grows=False, closes=False, unit=unit,
                    fit=fit, samples=tr.samples(x)))
            if not accepted and entry_state is not None:
                self.forward_state.put_back(entry_state)
            self.follow(moving, tr.Outcome(accepted, False, False))
            if tracks and not accepted:
                # Out of the metrics (the compiled loss's per-output trackers moved
                # before the screen) and the batch's loss.
                restore(model.metrics_variables, entry_metrics)
                continue
            model.compute_metrics(x, y, y_pred, sample_weight)
            # The batch's loss weighs each micro-batch as the loss tracker would.
            logged = float(fit_logs.logged_weight(self.policy, x, weight))
            weighted_loss += float(loss.detach()) * logged
            weights += logged
        fit.add("epoch_step", 1)
        if self.loss_scaled:
            # One finite step of the scale's count per batch, as Keras counts them,
            # when no micro-batch of the batch overflowed.
            counter, scale = record.loss_scale()
            if int(record.get("skipped")) == skipped_before:
                counter, scale = loss_scaling.grown_by(counter, scale, 1, self.growth_steps)
                record.set_loss_scale(counter, scale)
        # (An out-of-memory error from here on is the update's: "auto" cannot retry it.)
        self.applying = True
        with torch.no_grad():
            applied = apply_now(self.policy, record, True, fit=fit)
        self.follow(None, tr.Outcome(False, applied, True))
        # The batch's loss, logged as Keras logs a step's on the whole batch.
        if weights > 0 or not tracks:
            loss = weighted_loss / weights if weights > 0 else 0.0
            kc.loss_tracker(model).update_state(loss, sample_weight=batch)
        return model.get_metrics_result()

    # Pieces -------------------------------------------------------------------------

    @eager
    def moving_start(self):
        """The followed layers' moving statistics before a forward pass."""
        if not self.follower:
            return None
        return [(mean.value.detach().clone(), variance.value.detach().clone())
                for mean, variance in self.follower.moving()]

    @eager
    def follow(self, start, outcome) -> None:
        """The followed layers after a micro-batch (`start`: their moving statistics
        before it; None: a window closed outside one): `core.moving_statistics`."""
        follower = self.follower
        if not follower:
            return
        named = self.state.variables
        moving = follower.moving()
        moved = None
        if start is not None:
            moved = [(mean.value.detach().clone(), variance.value.detach().clone())
                     for mean, variance in moving]
        else:
            start = [(mean.value.detach().clone(), variance.value.detach().clone())
                     for mean, variance in moving]
        with torch.no_grad():
            statistics, values = follower.step(
                {name: named[name].value.detach().clone() for name in follower.names()},
                start, moved, *outcome)
            for name, value in statistics.items():
                named[name].value.copy_(tensor(value))
            for (mean, variance), (new_mean, new_variance) in zip(moving, values):
                mean.value.copy_(tensor(new_mean))
                variance.value.copy_(tensor(new_variance))

    @eager
    def counters(self) -> dict:
        """`updates`, `window_micro_batches`, `window_weight` and `skipped` of the
        window of the optimizer `updates` counts."""
        if self.appliers:
            index = min(self.appliers)
            optimizer = self.appliers[index][0]
        else:
            index, optimizer = 0, self.model.optimizer
        # Read as float32 tensors (no sync with the device each step; Keras turns
        # logs into numbers where it shows them).
        named = self.state.variables
        prefix = window_prefix(index)
        logs = {
            "updates": tensor(optimizer.iterations).float(),
            "window_micro_batches": named[prefix + "last_window_micro_batches"].value.float(),
            "window_weight": named[prefix + "last_window_weight"].value.float(),
        }
        if fit_logs.skips_possible(self.policy, self.loss_scaled):
            # Every optimizer's window saw the same micro-batches: the one that
            # skipped most counts.
            counts = [named[window_prefix(j) + "skipped"].value
                      for j in (sorted(self.appliers) or [0])]
            logs["skipped"] = (counts[0] if len(counts) == 1
                               else torch.stack(counts).max()).float()
        return logs

