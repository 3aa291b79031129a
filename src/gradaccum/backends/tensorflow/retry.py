"""`micro_batch_size="auto"`: a batch whose step runs out of memory runs again with
smaller micro-batches, and the failed attempt leaves no trace.

The train function `fit` calls is wrapped: it takes the batch from the iterator
itself, so that the same batch can be given to the step again. Before each batch it
keeps the values of what a step changes before its update: the metrics, the model's
small non-trainable variables (batch normalization statistics, random seeds) and
gradaccum's counters; the window is empty when a batch starts (split mode applies
at the end of every batch). A step that fails for memory before it reached its
update is rolled back to those values and run again with the next size of the
search (`gradaccum.core.auto_size.AutoSize`); one that failed while applying its update cannot be
retried (the optimizer may have changed) and raises.
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum.backends.tensorflow import split as _split

# Non-trainable variables larger than this are not copied before every batch.
from gradaccum.core.state import LARGEST_KEPT  # noqa: E402


class Snapshot:
    """The values of `variables` (each replica's copy) at one moment, to put back."""

    def __init__(self, variables, strategy):
        parts = []
        seen = set()
        for variable in variables:
            for part in strategy.experimental_local_results(variable):
                if id(part) not in seen:
                    seen.add(id(part))
                    parts.append(part)
        self._parts = parts
        self._values = None

    def take(self) -> None:
        self._values = [tf.identity(part) for part in self._parts]

    def restore(self) -> None:
        for part, value in zip(self._parts, self._values):
            part.assign(value)


def _changing_variables(accumulation) -> list:
    """What a split step changes before its update, other than the window."""
    host = accumulation.host
    state = accumulation.state
    variables = list(host.metrics_variables)
    variables += [
        v for v in host.non_trainable_variables if v.shape.num_elements() <= LARGEST_KEPT
    ]
    variables += [state.epoch_step, state.term_ratios, state.inexact, state.unequal]
    # The followed BatchNormalization layers' window statistics (a split batch is
    # its window: they start empty, and a failed attempt must leave them so).
    variables += list(state.statistics.values())
    for acc in state.accumulators():
        variables += [acc.state.skipped, acc.state.micro_batches]
    return variables


def _reset_windows(accumulation) -> None:
    for acc in accumulation.state.accumulators():
        acc.reset()


def resetting_on_error(accumulation, function):
    """Split mode: a step that raises (a non-finite gradient with
    `nonfinite="raise"`, an interrupted run) leaves no half-filled window behind; a
    batch's window is empty when the next batch starts."""

    def train_function(iterator):
        try:
            return function(iterator)
        except Exception:
            _reset_windows(accumulation)
            raise

    train_function.gradaccum_wrapped = True
    return train_function


def retrying(accumulation, function):
    """The train function `fit` calls, running each batch through `function`
    (Keras's, given one batch at a time) with the micro-batch size of the search,
    smaller after an out-of-memory error."""
    host = accumulation.host
    search = accumulation.auto_size
    strategy = host.distribute_strategy
    cache = {}

    def snapshot():
        """The snapshot of what a step changes, made again when that grew: the
        first step's trace creates the compiled metrics and a model's own step
        its accumulators."""
        state = accumulation.state
        key = (
            id(state),
            len(state.own),
            len(host.metrics_variables),
            len(host.non_trainable_variables),
        )
        if cache.get("key") != key:
            cache.update(
                key=key, snapshot=Snapshot(_changing_variables(accumulation), strategy)
            )
        return cache["snapshot"]

    def roll_back(kept):
        """Undoes a failed attempt; returns the snapshot to keep from now on."""
        _reset_windows(accumulation)
        fresh = snapshot()
        if fresh is not kept:
            # Metrics the failed attempt created (traced) held their initial
            # values before it: reset every metric, then put back the others.
            host.reset_metrics()
        kept.restore()
        if fresh is not kept:
            fresh.take()
        return fresh

    def run_batch(data):
        state = accumulation.state
        batch = _split.eager_batch_size(
            data, strategy if strategy.num_replicas_in_sync > 1 else None
        )
        kept = snapshot()
        kept.take()
        while True:
            size = min(search.size_for(batch), max(batch, 1))
            state.micro_batch_size.assign(size)
            # Set here, not in the step: ops on different variables are not ordered
            # there, and a failure may come before the step's first op ran.
            state.applying.assign(False)
            try:
                logs = function(iter([data]))
            except tf.errors.ResourceExhaustedError as error:
                if bool(state.applying.numpy()):
                    _reset_windows(accumulation)
                    error.add_note(
                        "gradaccum: micro_batch_size='auto' cannot retry this batch: "
                        "memory ran out while the optimizer applied the update, "
                        "which a smaller micro-batch does not change."
                    )
                    raise
                kept = roll_back(kept)
                if size <= 1:
                    error.add_note(
                        "gradaccum: micro_batch_size='auto' ran out of memory with "
                        "micro-batches of 1 sample."
                    )
                    raise
                search.failed(size)
                continue
            except Exception:
                _reset_windows(accumulation)
                raise
            search.ran(size)
            accumulation.size_chosen()
            if isinstance(logs, dict):
                logs = dict(logs, micro_batch_size=float(search.chosen))
            return logs

    def train_function(iterator):
        logs = None
        for _ in range(max(1, int(host.steps_per_execution))):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if logs is None:
                    raise
                break
            logs = run_batch(data)
        return logs

    train_function.gradaccum_wrapped = True
    return train_function
