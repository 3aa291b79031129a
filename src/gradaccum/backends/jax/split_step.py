"""Split mode on JAX (`micro_batch_size`): the batch is the window, cut into
micro-batches inside the compiled step (a `lax.scan`), laid out across a
keras.distribution's data shards (`Shards`), and applied once. What each micro-batch
does to the window is `gradaccum.core.transitions`, as in Keras's default step
(`step.TrainStep`, whose parts it uses: `gradients`, `record`, `follow`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras

from gradaccum.backends.jax.record import Carry, FitRecord, where_accepted
from gradaccum.core import fit_logs, loss_scaling
from gradaccum.core import transitions as tr
from gradaccum.core.state import ERROR_FIELDS, accumulator_name
from gradaccum.core.validation import split_batch_size as batch_size


def split_batch(step, carry: Carry, data, size):
    """Split mode: the batch is the window, cut into micro-batches of `size`
    samples run one at a time (a `lax.scan` over the whole ones, then the
    shorter last one if the batch leaves one), and applied once. Under a
    keras.distribution each micro-batch takes an equal part of every data
    shard (`Shards`), so that each device computes on its own samples.

    Args:
        step: the `TrainStep` (its policy, records, gradients and followers).
        carry: the step's values (`record.Carry`), changed in place.
        data: the batch, as Keras hands it to the step.
        size: the micro-batches' number of samples.

    Returns:
        The batch's logs (its loss and metrics as Keras logs a step's).
    """
    halted = carry.fields["error"] > 0
    entry = dict(carry.fields)
    batch = batch_size(data)
    shards = Shards.of_batch(size)
    if batch % shards.count:
        raise ValueError(
            "A batch split into micro-batches under a keras.distribution must hold "
            "a multiple of the number of devices it is sharded over. Received: a "
            f"batch of {batch} samples sharded over {shards.count} devices"
        )
    part = size // shards.count
    whole, rest = divmod(batch // shards.count, part)
    trainable = list(carry.trainable)
    fit = FitRecord(carry)
    fit.add("epoch_step", 1)
    loss_scale = step.growth_steps if step.loss_scaled else None
    tracks_skips = fit_logs.tracks_skips(step.policy, step.loss_scaled)

    def run(scanned, micro):
        non_trainable, optimizer_variables, metrics_variables, fields, weighted, weights = scanned
        inner = Carry(trainable, non_trainable, optimizer_variables, metrics_variables,
                      fields)
        record = step.record(inner)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(micro)
        loss, y_pred, weight, gradients, normalizers, weighted_gradients, unit = (
            step.gradients(inner, record, x, y, sample_weight,
                           length=batch / size)
        )
        tr.track_terms(FitRecord(inner), record, normalizers)
        inner.non_trainable = list(step.forward_state)
        accepted = tr.micro_batch(
            step.policy, record, gradients, weight, weighted=weighted_gradients,
            loss_scale=loss_scale, grows=False, closes=False, unit=unit,
            fit=FitRecord(inner), samples=tr.samples(x), pieces=step.noise_pieces,
        )
        inner.non_trainable = where_accepted(accepted, inner.non_trainable, non_trainable)
        step.follow(inner, non_trainable, step.forward_state,
                    tr.Outcome(accepted, False, False))
        _, inner.metrics = step.stateless_metrics(
            step.forward_metrics, None, None,
            lambda: step.model.compute_metrics(x, y, y_pred, sample_weight),
        )
        # The batch's loss weighs each micro-batch as the loss tracker would.
        weight = fit_logs.logged_weight(step.policy, x, weight).astype("float32")
        loss = loss.astype("float32")
        if tracks_skips:
            # A skipped micro-batch's loss and metrics join nothing.
            inner.metrics = where_accepted(accepted, inner.metrics, metrics_variables)
            loss = jnp.where(accepted, loss, 0.0)
            weight = jnp.where(accepted, weight, 0.0)
        weighted = weighted + loss * weight
        return (list(inner.non_trainable), list(inner.optimizer), list(inner.metrics),
                inner.fields, weighted, weights + weight), None

    # The batch's sums start from zero in the step (the state keeps none).
    for i, variable in enumerate(trainable):
        name = accumulator_name(i)
        dtype = entry[name].dtype
        carry.fields[name] = (jnp.zeros(variable.shape, dtype) if step.rows is None
                              else step.rows.zeros(i, variable.shape, dtype))
    zero = jnp.zeros((), "float32")
    scanned = (list(carry.non_trainable), list(carry.optimizer), list(carry.metrics),
               carry.fields, zero, zero)
    stacked, tail = shards.cut(data, whole, part, rest)
    if whole == 1:
        scanned, _ = run(scanned, jax.tree_util.tree_map(lambda t: t[0], stacked))
    elif whole > 1:
        scanned, _ = jax.lax.scan(run, scanned, stacked)
    if rest:
        scanned, _ = run(scanned, tail)
    before = (list(carry.non_trainable), list(carry.optimizer), list(carry.metrics))
    (carry.non_trainable, carry.optimizer, carry.metrics, carry.fields, weighted,
     weights) = scanned
    carry.non_trainable, carry.optimizer = list(carry.non_trainable), list(carry.optimizer)
    record = step.record(carry)
    if step.loss_scaled:
        # One finite step of the scale's count per batch, as Keras counts them,
        # when no micro-batch of the batch overflowed.
        counter, scale = record.loss_scale()
        grown = loss_scaling.grown_by(counter, scale, 1, step.growth_steps)
        finite = record.get("skipped") == entry["skipped"]
        record.set_loss_scale(jnp.where(finite, grown[0], counter),
                              jnp.where(finite, grown[1], scale))
    # An error in this batch (a non-finite gradient with nonfinite="raise", a
    # negative weight) leaves no update and no window: fit raises after the call.
    failed = (carry.fields["error"] > 0) & ~halted
    applied = tr.apply_now(step.policy, record, ~failed, fit=fit)
    step.follow(carry, carry.non_trainable, None, tr.Outcome(False, applied, ~failed))
    for i in range(len(trainable)):
        name = accumulator_name(i)
        carry.fields[name] = entry[name]
    # The batch's loss, logged as Keras logs a step's on the whole batch.
    loss = jnp.where(weights > 0, weighted / jnp.where(weights > 0, weights, 1.0), 0.0)
    # (Where skips leave the trackers, a batch whose every micro-batch was
    # skipped weighs nothing.)
    batch_weight = jnp.asarray(batch, "float32")
    if tracks_skips:
        batch_weight = jnp.where(weights > 0, batch_weight, 0.0)
    logs, carry.metrics = step.stateless_metrics(
        carry.metrics, loss, batch_weight, step.model.get_metrics_result
    )
    if step.policy.raises:
        # A batch that failed changes nothing but its error's fields.
        kept = dict(entry, **{field: carry.fields[field] for field in ERROR_FIELDS})
        kept["epoch_step"] = carry.fields["epoch_step"]
        after = (carry.trainable, carry.non_trainable, carry.optimizer, carry.metrics,
                 carry.fields)
        old = (trainable, *before, kept)
        (carry.trainable, carry.non_trainable, carry.optimizer, carry.metrics,
         carry.fields) = jax.tree_util.tree_map(
            lambda new, old: jnp.where(failed, old, new), after, old
        )
    return logs


class Shards:
    """How a batch is laid out across devices (keras.distribution shards its first
    dimension over the mesh axis of the data), and the micro-batches cut from it so
    that no sample moves: micro-batch j is the j-th run of `size / count` samples
    of every shard, side by side. Without a distribution there is one shard and the
    micro-batches are consecutive. Exact weighting makes an update independent of
    which samples share a micro-batch.

    Args:
        count: the number of shards of the batch.
        axis: the mesh axis (or axes) the batch is sharded over, None for one shard.
        mesh: the JAX mesh, None for one shard.
    """

    def __init__(self, count=1, axis=None, mesh=None):
        self.count, self.axis, self.mesh = count, axis, mesh

    @classmethod
    def of_batch(cls, size=None) -> Shards:
        """The shards of the current distribution's batches; a micro-batch `size`
        must split evenly over them."""
        distribution = keras.distribution.distribution()
        if distribution is None:
            return cls()
        layout = distribution.get_data_layout((1,))
        axis = layout.axes[0]
        if axis is None:
            return cls()
        mesh = layout.device_mesh
        sizes = dict(zip(mesh.axis_names, mesh.shape))
        count = 1
        for name in (axis,) if isinstance(axis, str) else tuple(axis):
            count *= sizes[name]
        if size is not None and size % count:
            raise ValueError(
                "`micro_batch_size` must be a multiple of the number of devices the "
                "batch is sharded over, so that each micro-batch takes an equal part "
                f"of every shard. Received: micro_batch_size={size} with batches "
                f"sharded over {count} devices (mesh axis {axis!r} of "
                f"{type(distribution).__name__})"
            )
        return cls(count, axis, mesh.backend_mesh)

    def cut(self, data, whole: int, part: int, rest: int):
        """The batch as `whole` micro-batches of `part` samples per shard, stacked
        on a new first dimension, and the shorter last one of `rest` samples per
        shard (None where there is none)."""
        count = self.count

        def shards(t):
            return t.reshape((count, t.shape[0] // count) + tuple(t.shape[1:]))

        def stacked(t):
            sample = tuple(t.shape[1:])
            body = shards(t)[:, : whole * part].reshape((count, whole, part) + sample)
            body = jnp.moveaxis(body, 0, 1).reshape((whole, count * part) + sample)
            return self.constrain(body, 1)

        def tail(t):
            last = shards(t)[:, whole * part:]
            return self.constrain(last.reshape((count * rest,) + tuple(t.shape[1:])), 0)

        body = jax.tree_util.tree_map(stacked, data) if whole else None
        last = jax.tree_util.tree_map(tail, data) if rest else None
        return body, last

    def constrain(self, array, dimension: int):
        """`array` sharded over the data's axis on `dimension` (the samples)."""
        if self.mesh is None:
            return array
        spec = [None] * array.ndim
        spec[dimension] = self.axis
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))
        return jax.lax.with_sharding_constraint(array, sharding)
