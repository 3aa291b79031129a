"""gradaccum's entries in `fit`'s logs on TensorFlow: `updates` (the optimizer's
update count), `window_micro_batches` and `window_weight` (what the last update's
window held), `skipped` (micro-batches skipped for a non-finite gradient) and, with
`micro_batch_size="auto"`, the size the search settled on.

`with_counters` reads them inside the compiled step (no host round trip per batch)
and packs them into one entry, with the step's own float32 scalar logs on one device
(the loss, the metrics, a float32 variable logged): each entry of a step's logs is an
output of the compiled call that Keras's trainer unwraps from a `tf.data` Optional
after every call, tens of microseconds apiece on a CPU, which showed at one
micro-batch per call. `unpacking` (around the train function) and `unpacked` (the
hook, for logs that reach it packed) give them their names back, as the Python floats
Keras hands its callbacks. The epoch's entries are the adapter's
(`gradaccum.adapter.Accumulation.write_logs`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.core import fit_logs


def tracked(accumulation, update, accepted, own=False):
    """Runs `update()` (what moves the trackers and returns the step's logs: the
    loss tracker's and the compiled metrics' update, or a model's own train_step)
    so that a micro-batch that `accepted()` (called after it) says was skipped
    leaves the model's trackers as they were, where the policy skips and goes on
    (`core.transitions.tracks_skips`): History, the progress bar and callbacks
    such as TerminateOnNaN see the micro-batches that were used. Returns the logs,
    each entry that is a tracker's result read after the skip was undone
    (`core.fit_logs.kept_logs`; by value too where `own`: a model's own
    step)."""
    host = accumulation.host
    if not fit_logs.tracks_skips(accumulation.policy, kc.is_loss_scale_optimizer(host.optimizer)):
        return update()
    variables = list(host.metrics_variables)
    before = [tf.identity(v.value) for v in variables]
    logs = update()
    used = accepted()
    if used is None:
        return logs
    moved = host.get_metrics_result()
    with tf.control_dependencies(tf.nest.flatten(moved)):
        for variable, old in zip(variables, before):
            variable.assign(tf.where(used, variable.value, old))
    return fit_logs.kept_logs(used, logs, host.get_metrics_result(), moved, by_value=own)


def updating_optimizer(accumulation):
    """The optimizer whose update count `updates` logs: the model's `optimizer`,
    unless the model's own train_step never handed it gradients while it trained
    other optimizers (a GAN's, created in its `compile`: `model.optimizer` is then
    Keras's unused default). Known once the step is traced."""
    optimizer = getattr(accumulation.host, "optimizer", None)
    # The optimizers the step handed gradients to (under several replicas
    # `model.optimizer` has an accumulator made before tracing, used or not).
    used = list(accumulation.own_step.handed) or [
        owner for _, owner in accumulation.state.own
    ]
    if not used or any(owner is optimizer for owner in used):
        return optimizer
    return used[0]


def logged_prefix(accumulation) -> str:
    """The prefix of the saved names of the accumulator that applies with the
    updating optimizer ("" for the exact step's, `own_<j>_` for a model's own
    step's)."""
    optimizer = updating_optimizer(accumulation)
    state = accumulation.state
    if state.accumulator is not None and accumulation.host.optimizer is optimizer:
        return ""
    for j, (_, owner) in enumerate(state.own):
        if owner is optimizer:
            return f"own_{j}_"
    return "own_0_" if state.own else ""


def last_window(accumulation) -> dict:
    """What the last update's window held (`window_micro_batches`, `window_weight`),
    of the accumulator that applies with the updating optimizer; empty before there
    is one."""
    optimizer = updating_optimizer(accumulation)
    state = accumulation.state
    pairs = list(state.own)
    if state.accumulator is not None:
        pairs.insert(0, (state.accumulator, accumulation.host.optimizer))
    for acc, owner in pairs:
        if owner is optimizer:
            return {
                "window_micro_batches": acc.last_window_micro_batches,
                "window_weight": acc.last_window_weight,
            }
    return {}


# The key of the packed entries: this prefix, then their names, comma-separated.
PACKED = "gradaccum_counters:"


def unpacked(logs):
    """`logs` (a dict, changed in place) with each packed entry replaced by its named
    float entries; anything else as it is."""
    if isinstance(logs, dict):
        for key in [k for k in logs if isinstance(k, str) and k.startswith(PACKED)]:
            values = np.asarray(logs.pop(key), "float64").reshape(-1).tolist()
            logs.update(zip(key[len(PACKED):].split(","), values))
    return logs


def unpacking(function):
    """The train function with its logs' packed entries named (eagerly, after it:
    Keras's TensorFlow backend reads every call's logs in the fit's thread anyway,
    its callbacks never running asynchronously)."""
    if getattr(function, "gradaccum_unpacks_counters", False):
        return function

    def run(*args, **kwargs):
        return unpacked(function(*args, **kwargs))

    run.gradaccum_unpacks_counters = True
    # What the function it wraps already does (split mode's retry, resuming).
    for name in ("gradaccum_wrapped", "gradaccum_skips"):
        setattr(run, name, getattr(function, name, False))
    return run


def _packable(key, value):
    """A step's log entry as the tensor that travels in the packed vector (a float32
    scalar, a variable read, under a name the packed key can carry), or None."""
    if not (isinstance(key, str) and "," not in key and not key.startswith(PACKED)
            and tf.is_tensor(value)):
        return None
    value = tf.convert_to_tensor(value)
    return value if value.dtype == tf.float32 and value.shape.rank == 0 else None


def with_counters(accumulation, logs):
    """The step's `logs` with the entries, read in the compiled step and packed into
    one float32 vector (`PACKED` and their names). On one device the step's float32
    scalar logs join the vector (exactly: they are float32 already): the compiled
    call then returns one entry instead of one per log. Under several replicas
    Keras reduces each entry across them, and the logs stay as the step gave them."""
    if not isinstance(logs, dict):
        return logs
    logs = dict(logs)
    packed = {}
    if accumulation.host.distribute_strategy.num_replicas_in_sync == 1:
        # In the order of their names: the packed key is the same for logs that hold
        # the same entries in another order (resuming's skip branch returns the
        # model's metrics, whose structure must match the step's).
        for key in sorted(k for k in logs if isinstance(k, str)):
            value = _packable(key, logs[key])
            if value is not None:
                packed[key] = value
                del logs[key]
    optimizer = updating_optimizer(accumulation)
    if optimizer is not None:
        packed["updates"] = tf.cast(optimizer.iterations, tf.float32)
    packed.update(
        {key: tf.cast(value, tf.float32) for key, value in last_window(accumulation).items()}
    )
    if fit_logs.skips_possible(accumulation.policy, accumulation.loss_scaled()):
        # Every optimizer's window saw the same micro-batches: the one that skipped
        # most counts.
        counts = [tf.cast(acc.skipped, tf.float32) for acc in accumulation.state.accumulators()]
        packed["skipped"] = tf.reduce_max(tf.stack(counts)) if counts else tf.constant(0.0)
    if packed:
        logs[PACKED + ",".join(packed)] = tf.stack(list(packed.values()))
    return logs
