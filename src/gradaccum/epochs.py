"""`fit`'s epochs under accumulation, on every backend: gradaccum's hook, first among
`fit`'s callbacks, and what a fit does as it starts and ends.

The hook keeps the fit record's epoch fields (the epoch's length, the position in
it, and after `BackupAndRestore` restored a position inside an epoch, the
micro-batches to skip), closes the window the data ends in as `partial` says,
writes the epoch's log entries and warns. It speaks to the model's accumulation
(`gradaccum.adapter.Accumulation`) only.
"""

from __future__ import annotations

import threading
import warnings

import keras
import numpy as np

from gradaccum import added_losses
from gradaccum.core import noise_scale
from gradaccum.weighting import micro_batch_sizes, uniform_message

EMPTY_FIT = (
    "`fit` must receive at least one micro-batch. Received: data that yielded no batch "
    "(an empty dataset or array), so nothing was accumulated or applied."
)


class EpochHook(keras.callbacks.Callback):
    """Runs first among fit's callbacks: the epoch's position and length, the window
    the data ends in, the epoch's log entries and the warnings.

    Its batch end is safe to run asynchronously (`async_safe`, unless the backend
    must see a batch's result before the next: `Accumulation.batch_end_async_safe`),
    so Keras keeps dispatching `fit`'s calls while a worker thread reads the last
    one's logs, as in plain `fit`: the accelerator never waits for the host. There
    it only reads the logs; what must happen in the fit's own thread (raising an
    error the step recorded) happens at the next batch's beginning or the epoch's
    end.

    Args:
        accumulation: the model's `gradaccum.adapter.Accumulation`.
    """

    def __init__(self, accumulation):
        super().__init__()
        self.accumulation = accumulation
        # Whether this fit has epochs to run (epochs > initial_epoch).
        self.epochs_to_run = True
        # Batches per epoch where the backend learns it otherwise than `params`.
        self.epoch_length = None
        self.calls = 0
        self.first_epoch = True

    @property
    def async_safe(self) -> bool:
        return self.accumulation.batch_end_async_safe()

    def _field(self, name):
        accumulation = self.accumulation
        accumulation.synced(self)
        return accumulation.fit_field(name)

    def on_train_begin(self, logs=None):
        accumulation = self.accumulation
        length = accumulation.epoch_length(self)
        self._field("epoch_length").assign(int(length) if length else -1)
        accumulation.skipped_at_start = accumulation.skipped()
        self.first_epoch = True
        self.calls = 0
        self._fit_thread = threading.get_ident()

    def on_epoch_begin(self, epoch, logs=None):
        epoch_step = self._field("epoch_step")
        # Restored (BackupAndRestore) inside an epoch: the epoch restarts from its
        # first batch, so skip what was already trained on; in no later epoch (a
        # restored position past the epoch's end skips this epoch only).
        skip = int(epoch_step.numpy()) if self.first_epoch else 0
        self._field("resume_skip").assign(skip)
        epoch_step.assign(0)
        self.first_epoch = False
        # The epoch's noise scale reads its own windows (a restored position inside
        # the epoch goes on with the windows it read before).
        if not skip:
            reset_noise(self.accumulation)
        self.accumulation.epoch_began(self, skip)

    def on_train_batch_begin(self, batch, logs=None):
        self.accumulation.before_batch(self)

    def on_train_batch_end(self, batch, logs=None):
        self.calls += 1
        # In a worker thread where Keras dispatches batch ends asynchronously.
        deferred = threading.get_ident() != self._fit_thread
        self.accumulation.after_batch(self, logs, deferred=deferred)

    def on_epoch_end(self, epoch, logs=None):
        accumulation = self.accumulation
        accumulation.synced(self)
        accumulation.after_batch(self, logs)
        accumulation.data_ends()
        accumulation.end_of_data()
        self._field("epoch_step").assign(0)
        accumulation.write_logs(logs)
        noise_logs(accumulation, logs)
        accumulation.warn()

    def on_train_end(self, logs=None):
        self.accumulation.synced(self)
        self.accumulation.end_of_data()
        if self.calls == 0 and self.epochs_to_run:
            raise ValueError(EMPTY_FIT)


def noise_fields(accumulation) -> dict:
    """The noise scale's fields (`core.noise_scale.FIELDS`) of the window record
    the logs report (the updating optimizer's), by name (each `numpy()`,
    `assign`); empty without `noise_scale` or before that record is made."""
    if not accumulation.options.noise_scale or accumulation.state is None:
        return {}
    named = accumulation.saved_variables()
    prefix = accumulation.logged_prefix()
    if prefix + "noise_trace" not in named:
        return {}
    return {name: named[prefix + name] for name in noise_scale.FIELDS}


def reset_noise(accumulation) -> None:
    """A new reading of the noise scale starts (the epoch's start), in every
    window record (each optimizer's of a model's own step)."""
    if not accumulation.options.noise_scale or accumulation.state is None:
        return
    for name, variable in accumulation.saved_variables().items():
        if name.endswith(noise_scale.TOTALS):
            variable.assign(np.zeros_like(variable.numpy()))


def noise_logs(accumulation, logs) -> None:
    """The epoch's `noise_scale` (B_simple in samples from its windows, NaN where
    none counted) in its `logs`."""
    fields = noise_fields(accumulation)
    if logs is None or not fields:
        return
    estimate = noise_scale.estimate(*(fields[name].numpy() for name in noise_scale.TOTALS))
    logs["noise_scale"] = estimate
    schedule = accumulation.options.window.steps
    if isinstance(schedule, noise_scale.NoiseScaleSchedule):
        # The k the epoch's last window opened with; at the epoch's end, the next
        # epoch's k from this epoch's estimate.
        held = int(fields["noise_steps"].numpy())
        logs["steps"] = float(held if held > 0 else schedule.initial_steps)
        following = schedule.steps_for(estimate)
        if schedule.every == "epoch" and following is not None:
            held = fields["noise_steps"]
            held.assign(np.asarray(following).astype(held.numpy().dtype))


def warn_loop_schedule(accumulation) -> None:
    """Before a `train_on_batch` call: warns once that a `NoiseScaleSchedule` set
    by epochs does not move there (no epoch ends in a loop of calls)."""
    schedule = accumulation.options.window.steps
    if (isinstance(schedule, noise_scale.NoiseScaleSchedule) and schedule.every == "epoch"
            and "loop_schedule" not in accumulation._warned):
        accumulation._warned.add("loop_schedule")
        warnings.warn(
            "NoiseScaleSchedule(every='epoch') sets k at fit's epochs: in a loop of "
            f"train_on_batch calls k stays {schedule.initial_steps}. Pass every=N to "
            "set it every N updates.", stacklevel=4)


def begin_fit(accumulation, hook, epochs, callbacks, kwargs):
    """As `fit` starts: `hook` first among the callbacks (and told whether there are
    epochs to run), the train function made again when the fit's ability to restore
    inside an epoch changed (the step that skips restored micro-batches costs a
    branch per micro-batch: compiled only for fits that can restore), and the epoch
    position at its start (BackupAndRestore may then restore one inside an epoch).
    Returns the callbacks to give `fit`."""
    hook.epochs_to_run = epochs > kwargs.get("initial_epoch", 0)
    callbacks, resumable = hook_first(hook, callbacks)
    if resumable != accumulation.resumable:
        accumulation.resumable = resumable
        accumulation.host.train_function = None
    if accumulation.state is not None:
        accumulation.fit_field("epoch_step").assign(0)
        accumulation.fit_field("resume_skip").assign(0)
        # A float8 window's weight is warned of per fit (`Accumulation.warn`).
        accumulation.fit_field("unequal").assign(False)
    accumulation.short_end = False
    return callbacks


def warn_added_losses(accumulation, x):
    """Before a model's first `fit` with windows of several micro-batches: warns
    once of each `add_loss` term summed over the batch, as `audit` names it
    (found on the data's first samples: `added_losses.probe`). Returns the `x`
    to train on (a generator whose first batch the probe read gives it back)."""
    options = accumulation.options
    if "added_losses" in accumulation._warned or not accumulation.layers.built or (
            not options.split and options.window.constant == 1):
        return x
    accumulation._warned.add("added_losses")
    layers, x = added_losses.probe(accumulation.layers, x)
    for layer in layers:
        warnings.warn("Accumulation is approximate for this model. "
                      + added_losses.cause(layer), stacklevel=4)
    return x

def warn_uniform(accumulation, x, batch_size, kwargs) -> None:
    """Before a `fit` on arrays under weighting='uniform': warns once, as `audit`
    names it, where its micro-batches are of unequal sizes (the last batch's
    rest, or a batch's rest in split mode), which then count the same."""
    options = accumulation.options
    if options.weighting != "uniform" or "uniform" in accumulation._warned or (
            not options.split and options.window.constant == 1):
        return
    sizes = micro_batch_sizes(x, batch_size, kwargs.get("validation_split"),
                              options.micro_batch_size if options.split else None)
    if sizes is not None and len(sizes) > 1:
        accumulation._warned.add("uniform")
        warnings.warn("Accumulation is approximate for this model. "
                      + uniform_message(sizes), stacklevel=4)


def after_fit(accumulation, failed: bool = False) -> None:
    """When a fit ends, however it ends (an error, an interrupt): no epoch runs
    outside it, so windows close by their rule only (`train_on_batch`); the fit's
    epoch length would otherwise close one at every micro-batch past it.
    `failed`: the fit raised, and its error is the one to see (Keras's JAX trainer
    may have taken the variables' values into its step and not given them back)."""
    if accumulation.state is None:
        return
    try:
        accumulation.fit_field("epoch_length").assign(-1)
        accumulation.fit_field("epoch_step").assign(0)
    except Exception:
        if not failed:
            raise


def hook_first(hook, callbacks):
    """`fit`'s callbacks with gradaccum's `hook` first, and whether they can restore
    inside an epoch (a `BackupAndRestore` among them).

    A caller's `CallbackList` is left as it is (the hook runs first, then the list,
    through `_Forward`); a plain list gets the hook in front.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        listed = callbacks.callbacks
        callbacks = keras.callbacks.CallbackList([hook, _Forward(callbacks)])
    else:
        callbacks = [hook, *(callbacks or [])]
        listed = callbacks
    resumable = any(isinstance(cb, keras.callbacks.BackupAndRestore) for cb in listed)
    return callbacks, resumable


class _Forward(keras.callbacks.Callback):
    """Passes every callback event on to a caller's `CallbackList`, untouched."""

    def __init__(self, callbacks):
        super().__init__()
        self._callbacks = callbacks

    def set_model(self, model):
        pass  # the caller's list keeps the model and params it was given

    def set_params(self, params):
        pass


for _event in [name for name in dir(keras.callbacks.Callback) if name.startswith("on_")]:
    setattr(
        _Forward,
        _event,
        lambda self, *args, _event=_event, **kwargs: getattr(self._callbacks, _event)(
            *args, **kwargs
        ),
    )


def size_chosen(accumulation) -> None:
    """`micro_batch_size="auto"` ran a batch: the host's `micro_batch_size` follows
    the search (`accumulation.auto_size`), which says once (when `fit` is verbose)
    where it settled."""
    search = accumulation.auto_size
    accumulation.host.__dict__["micro_batch_size"] = search.chosen
    # Said when a size that ran out of memory decided it (and again if the search
    # later settles elsewhere); without a failure nothing is split.
    if (search.settled and search.fails is not None
            and accumulation.announced != search.chosen):
        accumulation.announced = search.chosen
        verbose = accumulation.verbose
        if verbose:
            failed = ", ".join(str(size) for size in search.failures)
            reason = f" ({failed} ran out of memory)" if failed else ""
            # On a line of its own, after the progress bar's.
            start = "\n" if verbose in (1, "auto") else ""
            print(
                f'{start}gradaccum: micro_batch_size="auto" settled on '
                f"{search.chosen} samples per micro-batch{reason}."
            )
