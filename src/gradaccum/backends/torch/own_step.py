"""A model's own torch `train_step(data)`, run as written, its optimizer calls
accumulated.

Keras's torch pattern: the step computes its loss, calls `loss.backward()` and hands
the parameters' `.grad` to `self.optimizer.apply(grads, variables)` (or
`apply_gradients`) under `torch.no_grad()`. While the step runs, every optimizer the
model holds (`self.optimizer`, a GAN's `self.g_optimizer` / `self.d_optimizer`) has
its `apply` replaced: the gradients go through that optimizer's window record
(`gradaccum.core.transitions`: screened, weighted, added and, when the window is due
or the data ends, applied), so a step that updates one network and then
differentiates through it sees the update wherever a window is due.
"""

from __future__ import annotations

import contextlib

import keras
import torch

from gradaccum import _keras_common as kc
from gradaccum.backends.torch.record import restore, snapshot, truth
from gradaccum.core import fit_logs
from gradaccum.core import transitions as tr
from gradaccum.core.validation import check_optimizer


def run(step, data) -> dict:
    """`steps` mode with the model's own `train_step(data)`. Returns its logs."""
    model = step.model
    fit = step.fit_record()
    fit.add("epoch_step", 1)
    step_name = f"{type(model).__name__}.train_step"
    tracks = fit_logs.tracks_skips(step.policy, step.loss_scaled)
    entry_metrics = snapshot(model.metrics_variables) if tracks else None
    entry_state = step.forward_state.take() if tracks else None
    start = step.moving_start()
    router = ApplyRouter(step, data, tr.end_of_data(fit), step_name)
    step.normalizers.start()
    with router.recording(), step.follower.observing():
        logs = step.accumulation.own_train_step(data)
    if not router.calls:
        raise ValueError(
            f"The train_step of {type(model).__name__} must hand its gradients to "
            "the model's optimizer (`self.optimizer.apply(grads, variables)`) for "
            "gradaccum to accumulate them. Received: a step that did not call it, "
            "so nothing would be trained."
        )
    step.appliers.update(router.appliers)
    accepted = any(router.accepted)
    if not accepted and entry_state is not None:
        step.forward_state.put_back(entry_state)
    # The moving statistics follow the first optimizer call's window (every
    # optimizer's saw the same micro-batches).
    step.follow(start, router.outcomes[0]._replace(accepted=accepted))
    logs = dict(logs) if isinstance(logs, dict) else logs
    if tracks and not all(router.accepted):
        # The step's own trackers leave out a micro-batch any of its optimizers
        # skipped, as Keras's step's do.
        moved = model.get_metrics_result()
        restore(model.metrics_variables, entry_metrics)
        trackers = model.get_metrics_result()
        logs = fit_logs.kept_logs(False, logs, trackers, moved)
    return logs


class ApplyRouter:
    """What the model's own step hands to each optimizer's `apply` (at most once per
    optimizer and step), taken through that optimizer's window.

    Args:
        step: the `TrainStep`.
        data: the micro-batch.
        end: whether the data ends with this micro-batch.
        step_name: the model's step, as errors name it.
    """

    def __init__(self, step, data, end, step_name: str):
        self.step = step
        self.micro_batch = keras.utils.unpack_x_y_sample_weight(data)
        self.end = end
        self.step_name = step_name
        self.appliers: dict[int, tuple] = {}
        self.accepted: list = []
        self.outcomes: list = []
        self.calls = 0
        self.called: set[int] = set()
        self.optimizers = [o for _, o in kc.named_optimizers(step.model)]

    def recorder(self, name, optimizer):
        known = [i for i, other in enumerate(self.optimizers) if other is optimizer]

        def apply(grads, trainable_variables=None):
            if not known:  # pragma: no cover - the routed optimizers are the known ones
                raise ValueError(f"`self.{name}` is not an optimizer of the model.")
            index = known[0]
            if index in self.called:
                raise ValueError(
                    "A model's own `train_step` must hand its gradients to "
                    f"`self.{name}.apply` once per step for gradaccum to accumulate "
                    f"them. Received: a second call in one step of {self.step_name}."
                )
            if trainable_variables is None:
                trainable_variables = optimizer._trainable_variables
            return self.accumulate(index, name, optimizer, list(grads),
                                   list(trainable_variables))

        def apply_gradients(grads_and_vars):
            grads, variables = zip(*grads_and_vars)
            return apply(list(grads), list(variables))

        return apply, apply_gradients

    def accumulate(self, index, name, optimizer, grads, variables):
        check_optimizer(optimizer)
        step = self.step
        if len(grads) != len(variables):
            raise ValueError(
                f"The gradients a model's own `train_step` hands to `self.{name}.apply` "
                "must be one per trainable variable handed with them. Received: "
                f"{len(grads)} gradients for {len(variables)} variables in "
                f"{self.step_name}."
            )
        known = {id(v) for v in step.variables}
        if any(id(v) not in known for v in variables):
            raise ValueError(
                f"A model's own `train_step` must hand `self.{name}.apply` trainable "
                "variables of the model, for gradaccum to keep their sums. Received: "
                f"a variable the model does not train in {self.step_name}."
            )
        self.calls += 1
        self.called.add(index)
        self.appliers[index] = (optimizer, tuple(id(v) for v in variables))
        policy = step.policy
        x, y, sample_weight = self.micro_batch
        record = step.record(index, optimizer, variables)
        fit = step.fit_record()
        normalizers = [n.detach() if isinstance(n, torch.Tensor) else n
                       for n in step.normalizers.since_last_call()]
        weight = tr.weigh(policy, x, y, sample_weight, normalizers, record, warn=False)
        tr.track_terms(fit, record, normalizers)
        scaled = kc.is_loss_scale_optimizer(optimizer)
        growth = int(optimizer.dynamic_growth_steps) if scaled else None
        with torch.no_grad():
            accepted = tr.micro_batch(policy, record, grads, weight, loss_scale=growth,
                                      end=self.end, fit=fit)
        self.accepted.append(truth(accepted))
        self.outcomes.append(record.outcome)

    @contextlib.contextmanager
    def recording(self):
        """While the step runs: each optimizer's `apply` goes through its window."""
        routed = kc.named_optimizers(self.step.model)
        for name, optimizer in routed:
            apply, apply_gradients = self.recorder(name, optimizer)
            optimizer.__dict__["apply"] = apply
            optimizer.__dict__["apply_gradients"] = apply_gradients
        try:
            with self.step.unrouted.watching([o for _, o in routed],
                                             type(self.step.model).__name__):
                yield self
        finally:
            for _, optimizer in routed:
                optimizer.__dict__.pop("apply", None)
                optimizer.__dict__.pop("apply_gradients", None)
