"""What `fit`'s logs show of accumulation: the weight a micro-batch's loss takes in
the loss tracker, the logs of a skipped micro-batch kept out of the trackers, and
gradaccum's own entries (`updates`, `window_micro_batches`, `window_weight`,
`skipped`)."""

from __future__ import annotations

import keras

from gradaccum.core.policy import Policy
from gradaccum.core.transitions import samples

ops = keras.ops


def tracks_skips(policy: Policy, loss_scaled: bool) -> bool:
    """Whether a skipped micro-batch's loss and metrics are kept out of the
    trackers (`fit`'s logs, the callbacks): wherever the policy skips a micro-batch
    and goes on (`"skip"`, a callable, loss scaling). With `"apply"` and `"raise"`
    the trackers see every micro-batch as it is."""
    return policy.nonfinite == "skip" or callable(policy.nonfinite) or loss_scaled


def logged_weight(policy: Policy, x, weight):
    """The weight a micro-batch's loss takes in the loss tracker (so in `fit`'s
    logs): its `w_i` under exact weighting, the loss's own normalizer, so a
    window's logged loss is its large-batch loss; else (uniform, a callable) its
    number of samples, as Keras's step weighs a batch's loss: the epoch's loss is
    then the per-sample mean plain Keras shows for the same micro-batches, whatever
    the gradient's weights."""
    if policy.weighting == "exact":
        return weight
    return samples(x)


def kept_logs(accepted, logs, trackers, moved, by_value=True):
    """A step's `logs` (its returned dict, nested dicts included) where its
    micro-batch may have been skipped. `moved`: the model's metric results after
    the micro-batch, `trackers`: the same after the skip was undone (equal where
    it was accepted). Where not `accepted`, an entry a tracker that moved in this
    step holds takes that tracker's value without the micro-batch: the tracker of
    its name, else any whose moved value the entry equals (keras.io's VAE logs its
    `total_loss` tracker as "loss"; a raw loss equal to a tracker's value reads it
    too). Other entries (a raw loss no moved tracker holds; a tracker that did not
    move, such as Keras's loss tracker in a step that keeps its own) stay as
    returned. Without `by_value` (Keras's step, whose logs are the trackers'
    results) entries match by name only."""
    if not isinstance(logs, dict):
        return logs
    return {name: (kept_logs(accepted, value, trackers, moved, by_value)
                   if isinstance(value, dict)
                   else _kept_entry(accepted, name, value, trackers, moved, by_value))
            for name, value in logs.items()}


def _kept_entry(accepted, name, value, trackers, moved, by_value):
    try:
        value = ops.convert_to_tensor(value)
    except (TypeError, ValueError):
        return value
    if not _is_float(value):
        return value
    kept = value
    # Applied last wins: other trackers by value first, the entry's name last.
    names = [other for other in trackers if other != name] if by_value else []
    if name in trackers:
        names.append(name)
    for other in names:
        after = moved.get(other)
        if after is None:
            continue
        tracker, after = ops.convert_to_tensor(trackers[other]), ops.convert_to_tensor(after)
        if tuple(tracker.shape) != tuple(value.shape) or not _is_float(tracker):
            continue
        tracker, after = ops.cast(tracker, value.dtype), ops.cast(after, value.dtype)
        moved_here = ops.logical_not(ops.all(_same(after, tracker)))
        if other != name:
            moved_here = moved_here & ops.all(_same(value, after))
        kept = ops.where(moved_here, tracker, kept)
    return ops.where(accepted, value, kept)


def _same(a, b):
    """Elementwise equality that counts nan as equal to nan."""
    return (a == b) | (ops.isnan(a) & ops.isnan(b))


def _is_float(tensor) -> bool:
    return "float" in str(tensor.dtype)


def skips_possible(policy: Policy, loss_scaled: bool) -> bool:
    """Whether a micro-batch can be skipped (then `skipped` is logged)."""
    return policy.nonfinite != "apply" or loss_scaled


def counters(record, iterations, skipped=None) -> dict:
    """gradaccum's entries in `fit`'s logs, as float32 tensors: `updates` (the
    optimizer's update count, `iterations`), `window_micro_batches` and
    `window_weight` (what the last update's window held) and, where given, `skipped`."""
    logs = {
        "updates": ops.cast(iterations, "float32"),
        "window_micro_batches": ops.cast(record.get("last_window_micro_batches"), "float32"),
        "window_weight": ops.cast(record.get("last_window_weight"), "float32"),
    }
    if skipped is not None:
        logs["skipped"] = ops.cast(skipped, "float32")
    return logs
