"""The callback that runs first among `fit`'s callbacks on TensorFlow: the epoch
position, the window policy at the end of the data, resuming inside an epoch under
`BackupAndRestore`, and the epoch's log entries."""

from __future__ import annotations

import keras
import tensorflow as tf

from gradaccum import _fit_common
from gradaccum.backends.tensorflow import logs as _logs
from gradaccum.backends.tensorflow.screening import compiled_raise_message
from gradaccum.backends.tensorflow.state import Untracked


class EpochHook(keras.callbacks.Callback):
    """Runs first among fit's callbacks: epoch position, end-of-data windows and the
    `updates`/`skipped` log entries.

    Args:
        accumulation: the `fit.Accumulation` of the model being trained.
    """

    def __init__(self, accumulation):
        super().__init__()
        self._accumulation = Untracked(accumulation)
        self._first_epoch = True
        self._calls = 0
        self._skipped_before = 0
        # Batches per epoch, as Keras's epoch iterator counts them (None: unknown).
        self.epoch_length = None
        # Whether this fit has epochs to run (epochs > initial_epoch).
        self.epochs_to_run = True

    @property
    def _state(self):
        return self._accumulation.value.state

    def on_train_begin(self, logs=None):
        steps = self.epoch_length
        self._state.epoch_length.assign(steps if steps else -1)
        self._first_epoch = True
        self._calls = 0
        self._skipped_before = self._state.skipped

    def on_train_batch_end(self, batch, logs=None):
        # Named before the callbacks after this one see them (logs that reach the
        # callbacks packed: under several workers).
        _logs.unpacked(logs)
        self._calls += 1
        accumulation = self._accumulation.value
        host = accumulation.host
        if accumulation.options.nonfinite == "raise" and host.jit_compile:
            # XLA compiles the step's assertion away (the micro-batch is skipped
            # instead): raise here, after the compiled call.
            skipped = self._state.skipped - self._skipped_before
            if skipped:
                raise tf.errors.InvalidArgumentError(
                    None, None, compiled_raise_message(skipped)
                )

    def on_epoch_begin(self, epoch, logs=None):
        state = self._state
        if self._first_epoch and int(state.epoch_step.numpy()) > 0:
            # Restored (BackupAndRestore) in the middle of an epoch: the epoch
            # restarts from its first batch, so skip what was already trained on.
            state.resume_skip.assign(state.epoch_step)
        state.epoch_step.assign(0)
        self._first_epoch = False

    def on_epoch_end(self, epoch, logs=None):
        accumulation = self._accumulation.value
        accumulation.end_of_data()
        self._state.epoch_step.assign(0)
        _logs.write(accumulation, logs)
        accumulation.warn_if_inexact()
        accumulation.warn_if_skipped()
        accumulation.warn_if_repeated()

    def on_train_end(self, logs=None):
        self._accumulation.value.end_of_data()
        if self._calls == 0 and self.epochs_to_run:
            raise ValueError(_fit_common.EMPTY_FIT)
