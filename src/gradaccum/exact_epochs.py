"""An epoch of the micro-batches the user asked for, whatever `steps_per_execution`.

Keras's epoch iterator hands its trainer `steps_per_execution` batches per compiled
call. With a length given by `steps_per_epoch` (or `steps`, `validation_steps`) that
is not a multiple of it, the last call of an epoch takes the whole
`steps_per_execution` from the data: more micro-batches than asked for, and the next
epoch starts further on in an endless (`.repeat()`) dataset. gradaccum chooses
`steps_per_execution` (the window), so it must not change what an epoch is
(`SEMANTICS.md`, "Epochs"): an epoch iterator made exact here counts micro-batches
as Keras does at `steps_per_execution=1`, and its last call takes only the rest.

A full call still gets Keras's own iterator (TensorFlow's compiled loop over it, JAX's
pull of `steps_per_execution` batches) where the data cannot run out inside it: its
length is known, or it never ends (a repeated `tf.data` dataset). The rest of an
epoch, and every call on data of unknown length (a generator, a filtered dataset),
goes as a Python iterator of that many batches, counted as it is read: each backend's
train function runs it one batch at a time (Keras's own path for an iterator that is
not TensorFlow's), and data that runs out inside a call ends the epoch as at one
batch per call (Keras's loops stop there without a word, and the next epoch would
read the spent iterator).
"""

from __future__ import annotations

import contextlib
import types

from gradaccum._keras_common import EpochIterator, overriding

# The attribute that marks an epoch iterator made exact (it may be seen twice).
MARK = "_gradaccum_exact"


def make_exact(epoch_iterator) -> None:
    """Makes `epoch_iterator` (Keras's `EpochIterator`) yield exactly the batches
    its `steps_per_epoch` asks for, in calls of at most `steps_per_execution`.
    Nothing changes without a length given or at one batch per call."""
    if getattr(epoch_iterator, MARK, False):
        return
    setattr(epoch_iterator, MARK, True)
    keras_enumerate = epoch_iterator._enumerate_iterator

    def enumerate_iterator(self):
        if not self.steps_per_epoch or self.steps_per_execution <= 1:
            yield from keras_enumerate()
            return
        yield from _exact_calls(self)

    epoch_iterator._enumerate_iterator = types.MethodType(enumerate_iterator, epoch_iterator)


def _exact_calls(it):
    """Keras's `EpochIterator._enumerate_iterator` for a length given, each call
    taking what is left of the epoch (and of data of a known length) at most."""
    it.data_adapter.on_epoch_begin()
    length, per_call = it.steps_per_epoch, it.steps_per_execution
    if it._current_iterator is None:
        it._current_iterator = iter(it._get_iterator())
        it._steps_seen = 0
    step = 0
    endless = _endless(it)
    while step < length:
        known = it._num_batches
        if known and it._steps_seen >= known:
            it._interrupted_warning()
            break
        take = min(per_call, length - step)
        if known:
            take = min(take, known - it._steps_seen)
        if take == per_call and (known or endless):
            it._steps_seen += per_call
            yield step, step + per_call - 1, it._current_iterator
        else:
            rest = _Rest(it, take)
            if rest.empty:
                return
            yield step, step + take - 1, rest
            if it._current_iterator is None:
                return  # the data ran out within the rest
        step += take
    if it._num_batches and it._steps_seen >= it._num_batches:
        it._current_iterator = iter(it._get_iterator())
        it._steps_seen = 0
    it.data_adapter.on_epoch_end()


def _endless(it) -> bool:
    """Whether the epoch iterator's data never ends: a `tf.data` dataset of infinite
    cardinality (`.repeat()`)."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter

    if not isinstance(it.data_adapter, TFDatasetAdapter):
        return False
    import tensorflow as tf

    dataset = it.data_adapter.get_tf_dataset()
    cardinality = dataset.cardinality
    cardinality = cardinality() if callable(cardinality) else cardinality
    return int(cardinality) == int(tf.data.INFINITE_CARDINALITY)


class _Rest:
    """A call's batches read one at a time: at most `count` from the epoch
    iterator's data, counted as Keras counts one batch per call. The first is drawn
    at once (a train function given no batch at all has nothing to return)."""

    def __init__(self, epoch_iterator, count: int):
        self._epoch_iterator = epoch_iterator
        self._left = count
        self._first = self._draw()
        self.empty = self._first is _NONE

    def __iter__(self):
        return self

    def __next__(self):
        if self._first is not _NONE:
            first, self._first = self._first, _NONE
            return first
        batch = self._draw()
        if batch is _NONE:
            raise StopIteration
        return batch

    def _draw(self):
        it = self._epoch_iterator
        if self._left <= 0 or it._current_iterator is None:
            return _NONE
        self._left -= 1
        it._steps_seen += 1
        # Keras's own bookkeeping of data that ran out, as at one batch per call
        # (the base class's: TensorFlow's adds a wait for the device per batch).
        with EpochIterator.catch_stop_iteration(it):
            return next(it._current_iterator)
        return _NONE


_NONE = object()


@contextlib.contextmanager
def observing_epochs(model, hook=None):
    """Within the block (a `fit` or an `evaluate`), every epoch iterator the model's
    trainer builds yields exactly the batches its length asks for
    (`make_exact`), and `hook.epoch_length` is set to the number of
    batches per epoch of the first (the training data's; None if unknown).

    Keras gives that count to callbacks as `params["steps"]` only when it builds the
    CallbackList itself; its `fit` and `evaluate` hand the epoch iterator to their
    symbolic build in every case, before the first callback event
    (`_maybe_symbolic_build` on TensorFlow, `_symbolic_build` elsewhere).
    """
    observed = {}
    seen = []
    for name in ("_maybe_symbolic_build", "_symbolic_build"):
        build = getattr(model, name, None)
        if build is None:
            continue

        def observe(*args, iterator=None, _build=build, **kwargs):
            if iterator is not None:
                make_exact(iterator)
                if hook is not None and not seen:
                    seen.append(iterator)
                    hook.epoch_length = iterator.num_batches
            return _build(*args, iterator=iterator, **kwargs)

        observed[name] = observe
    with overriding(model, **observed):
        yield
