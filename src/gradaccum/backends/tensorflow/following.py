"""Keras's BatchNormalization layers followed through the window on TensorFlow
(`gradaccum.core.moving_statistics`): the moving variables read before a
micro-batch and after its forward pass, and the window's statistics kept in the fit
state's variables (`state.FitState.statistics`). Reads and writes are ordered by
TensorFlow's automatic control dependencies on the variables."""

from __future__ import annotations

import tensorflow as tf

from gradaccum.core.transitions import Outcome


def _read(follower) -> list:
    return [(tf.identity(mean.value), tf.identity(variance.value))
            for mean, variance in follower.moving()]


def begin(accumulation):
    """The followed layers' moving (mean, variance) before a micro-batch; None where
    no layer is followed."""
    follower = accumulation.follower
    if not follower:
        return None
    return _read(follower)


def end(accumulation, start, outcome: Outcome, moved: bool = True) -> None:
    """After a micro-batch (`moved`: its forward pass moved the layers) or a window
    closed outside one: the micro-batch's statistics pooled where accepted, the
    moving statistics moved once where the window applied, else put back."""
    if start is None:
        return
    follower = accumulation.follower
    statistics = accumulation.state.statistics
    values = {name: tf.convert_to_tensor(v) for name, v in statistics.items()}
    values, moving = follower.step(values, start, _read(follower) if moved else None,
                                   *outcome)
    for name, value in values.items():
        statistics[name].assign(value)
    for (mean, variance), (new_mean, new_variance) in zip(follower.moving(), moving):
        mean.assign(new_mean)
        variance.assign(new_variance)


def settle(accumulation, applied, closed=True) -> None:
    """A window closed outside a micro-batch (the end of the data, split mode's
    update): moved once where `applied`, forgotten where `closed`."""
    end(accumulation, begin(accumulation), Outcome(False, applied, closed), moved=False)
