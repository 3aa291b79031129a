"""Accumulation inside Keras's `fit()` on PyTorch: the adapter
(`gradaccum.adapter.Accumulation`) `accumulate` and `wrap` attach to a model.

`Accumulation` owns the state (`state.TorchState`: variables outside the model, so
the model's weights and file stay Keras's own) and the step (`step.TrainStep`);
what `fit` does alike on every backend (its epochs, logs, saving) is the base
class's. Here: where the state lives, and closing a window outside the step at the
end of the data.
"""

from __future__ import annotations

import warnings

import torch

from gradaccum import _keras_common as kc
from gradaccum import adapter
from gradaccum.backend_interface import Findings
from gradaccum.backends.torch.record import Runner
from gradaccum.backends.torch.state import TorchState, window_prefix
from gradaccum.backends.torch.step import TrainStep
from gradaccum.core import transitions as tr
from gradaccum.core.combine import combine
from gradaccum.core.options import Options


def torch_statistics(model) -> list:
    """`(layer, module names)` of each `keras.layers.TorchModuleWrapper` in `model`
    that holds torch modules with running statistics (`torch.nn.BatchNorm*`)."""
    import keras

    found = []
    for layer in kc.flatten_layers(model):
        module = getattr(layer, "module", None)
        if not isinstance(layer, keras.layers.TorchModuleWrapper) or module is None:
            continue
        names = [type(m).__name__ for m in module.modules()
                 if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                 and m.track_running_stats]
        if names:
            found.append((layer, names))
    return found


def warn_torch_statistics(model) -> None:
    """A warning naming each wrapped torch module gradaccum cannot follow: its
    running statistics are buffers outside Keras's variables."""
    for layer, names in torch_statistics(model):
        warnings.warn(
            f"Layer {layer.name!r} wraps torch module(s) with running statistics "
            f"({', '.join(sorted(set(names)))}): under gradaccum they move at every "
            "micro-batch, not once per window, and a micro-batch skipped for a "
            "non-finite gradient moves them too (their buffers are not Keras "
            "variables, which gradaccum follows and puts back). Use "
            "keras.layers.BatchNormalization to have them follow the window, or pass "
            "moving_statistics=\"micro_batch\" to silence this.",
            stacklevel=5,
        )


class Accumulation(adapter.Accumulation):
    """Gradient accumulation attached to a model that `fit` trains on PyTorch.

    Args:
        options: the checked `Options`.
        layers: the model trained (the host itself, or `wrap`'s inner model).
    """

    backend_name = "PyTorch"
    runner = Runner()
    # Keras's torch trainer runs one batch per call.
    runs_several_steps = False
    splits_own_step = False

    def __init__(self, options: Options, layers):
        super().__init__(options, layers)
        self.state: TorchState | None = None
        self.step: TrainStep | None = None
        self._variables: list = []
        self._noise = None

    def detach(self) -> None:
        self.state = None
        self.step = None

    # State --------------------------------------------------------------------------

    def ensure_state(self) -> None:
        if self.state is not None:
            return
        host = self.host
        terms = self.check_trainable()
        optimizer = host.optimizer
        if not optimizer.built:
            optimizer.build(host.trainable_variables)
        self._variables = list(host.trainable_variables)
        follower = self.follow()
        if self.options.follows_moving_statistics:
            warn_torch_statistics(self.layers)
        records = len(kc.named_optimizers(host)) if self.own_train_step is not None else 1
        self.state = TorchState(
            self._variables, self.options.accumulator_dtype, records=max(1, records),
            terms=terms, private=self.options.privacy is not None,
            statistics=follower.fields(), noise=self.options.noise_scale,
        )
        self.restore_pending()

    def drop_state(self) -> None:
        self.state = None
        self.step = None
        if self.host is not None:
            self.host.train_function = None

    def fit_field(self, name: str):
        assert self.state is not None, "called with a state"
        return self.state.variables[name]

    def saved_variables(self) -> dict:
        return {} if self.state is None else self.state.named()

    def windows(self) -> list:
        return [("", self._variables, ())]

    def window_values(self, name: str) -> list:
        assert self.state is not None, "called with a state (adapter.Accumulation checks)"
        named = self.state.variables
        return [int(named[window_prefix(j) + name].numpy()) for j in range(self.state.records)]

    # fit ----------------------------------------------------------------------------

    def _ensure_step(self) -> TrainStep:
        if self.step is None:
            self.step = TrainStep(self)
        return self.step

    def make_train_function(self, make, force=False):
        self.ensure_state()
        if self.step is None:
            force = True
        self._ensure_step()
        make(force)
        return self.host.train_function

    def train_step(self, data):
        return self._ensure_step()(data)

    def noise(self):
        """With `gradaccum.Privacy`: the window's noise (`record.WindowRecord`)."""
        if self.options.privacy is None:
            return None
        if self._noise is None:
            from gradaccum.backends.torch import privacy

            self._noise = privacy.Noise(self.options.privacy)
        return self._noise

    def end_of_data(self) -> None:
        """The data ended: the open windows are flushed or dropped as `partial`
        says (kept with `"carry"`)."""
        if self.state is None or self.options.partial == "carry":
            return
        if self.open_micro_batches() == 0:
            return
        self.close_eagerly(apply=self.options.partial == "flush")

    def close_eagerly(self, apply: bool) -> bool:
        """Closes the open windows outside the step: each applied when `apply` and it
        holds an accepted micro-batch, else dropped. Returns whether an update
        happened."""
        step = self._ensure_step()
        appliers = self._appliers()
        if appliers is None:
            self.warn_appliers_unknown()
            return False
        applied_any = False
        first = None
        fit = step.fit_record()
        for index, (optimizer, variables) in sorted(appliers.items()):
            record = step.record(index, optimizer, variables)
            if int(tr.window_length(record)) == 0:
                continue
            with torch.no_grad():
                if apply:
                    applied = bool(tr.apply_now(self.policy, record, True, fit=fit))
                else:
                    tr.drop(record)
                    applied = False
            applied_any = applied_any or applied
            if first is None:
                first = applied
        if first is not None:
            # The window's moving statistics move with its update, or are forgotten.
            step.follow(None, tr.Outcome(False, first, True))
        return applied_any

    def _appliers(self):
        """`{record: (optimizer, variables)}` of the windows, None where a model's
        own step has not run in this process."""
        step = self.step
        if self.own_train_step is None:
            return {0: (self.host.optimizer, list(self._variables))}
        if not step.appliers:
            return None
        by_id = {id(v): v for v in self._variables}
        return {index: (optimizer, [by_id[i] for i in ids])
                for index, (optimizer, ids) in step.appliers.items()}

    # Logs ---------------------------------------------------------------------------

    def logged_prefix(self) -> str:
        return window_prefix(min(self._appliers() or {0: None}))

    def last_window(self) -> tuple:
        assert self.state is not None, "called with a state"
        named = self.state.variables
        appliers = self._appliers() or {0: (self.host.optimizer, None)}
        index = min(appliers)
        optimizer = appliers[index][0]
        prefix = window_prefix(index)
        return (optimizer.iterations.numpy(),
                named[prefix + "last_window_micro_batches"].numpy(),
                named[prefix + "last_window_weight"].numpy())

    # The audit and privacy ------------------------------------------------------------

    def window_gradients(self) -> list:
        if self.state is None:
            return []
        named = self.state.variables
        appliers = (self._appliers() if self.step is not None or self.own_train_step is None
                    else None) or {0: (None, list(self._variables))}
        place = {id(v): i for i, v in enumerate(self._variables)}
        pairs = []
        for j, (_, variables) in sorted(appliers.items()):
            slots = [place[id(v)] for v in variables]
            combined = combine(
                [named[f"accumulator_{i}"].value for i in slots],
                named[window_prefix(j) + "total_weight"].value, self.options.reduction,
                [v.dtype for v in variables],
            )
            # Copies: the sums themselves under reduction "sum".
            pairs += [(v, g.clone()) for v, g in zip(variables, combined)]
        return pairs

    def findings(self) -> Findings:
        optimizers = []
        if self.step is not None and self.own_train_step is not None:
            optimizers = [kc.optimizer_name(self.host, optimizer)
                          for _, (optimizer, _) in sorted(self.step.appliers.items())]
        return Findings(repeated=[], stale=[], stale_known=False, optimizers=optimizers,
                        inexact=bool(self.state is not None and self.inexact()),
                        skipped=self.skipped())

    def privacy_record(self) -> tuple[int, float]:
        if self.state is None:
            return 0, 0.0
        return (int(self.state.variables["updates"].numpy()),
                float(self.state.variables["largest_window"].numpy()))
