"""Each device's own sums under a keras.distribution on JAX: one all-reduce per update.

Under `DataParallel`, or on the batch axis of `ModelParallel`, each of the N devices
of the batch axis holds a shard of every micro-batch. Left to XLA, the gradient of a
micro-batch is all-reduced across them before it is added to the sums: k all-reduces
per update. Here each device differentiates its own shard of the micro-batch
(`jax.shard_map` over the batch axis, the model's other axes left to XLA) and adds the
result to its own row of the sums, which have one row per device: shape
`(N, *variable.shape)`, the rows sharded over the batch axis, so a device holds one
row, the memory of one sum as before. Nothing crosses devices until the window closes,
where the rows are added up inside the update's branch: one all-reduce per update.

Why the rows add up to the one-device gradient: Keras's compiled loss divides the
device's summed loss by its normalizer `n_d` (its samples, or their weights, or its
unmasked tokens); the micro-batch's loss divides the whole sum by `n = sum(n_d)`. So
device d differentiates its loss times `n_d / n` (reduction "mean"; as it is under
reduction "sum", where the losses add), a scalar all-reduce of `n_d`. The shares add
to 1, so regularization losses, the same on every device, count once.

Dropout and other random layers draw from each device's own seed (the seed state
offset by the device's index), so the devices' masks are independent, as one device's
would be across its samples.

`plan` says, before the state is made, whether a model can keep its sums per device,
and why not (said in a warning): a layout that shards a variable over the batch axis,
a layer whose statistics span the batch (BatchNormalization), float8 layers, a
`nonfinite` callable (which reads the whole gradient), privacy, a model's own
`train_step`. What only tracing tells (a loss with several normalized terms, a
variable the forward pass changes from the samples) falls back when the step is
traced: the micro-batch's gradient is then reduced as before and added into row 0,
with the same warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import PartitionSpec

from gradaccum.backends.jax.split_step import Shards

# Added to a seed's first word times the device's index: a distinct stream per device.
_SEED_STRIDE = 0x9E3779B1


class Unsupported(Exception):
    """Raised while tracing a device's step that cannot be cut per device: why."""


@dataclass(frozen=True)
class DeviceRows:
    """The sums' rows: one per device of the batch axis.

    Args:
        count: N, the devices the batch is sharded over.
        axes: the mesh axis names of the batch (one, or several together).
        mesh: the JAX mesh.
        described: the distribution and its batch axis, for messages.
    """

    count: int
    axes: tuple
    mesh: object
    described: str

    def spec(self, dimensions: int) -> PartitionSpec:
        """Rows sharded over the batch axes, the other `dimensions` whole."""
        return PartitionSpec(self.axes if len(self.axes) > 1 else self.axes[0],
                             *([None] * dimensions))

    def layout(self, variable_layout, shape) -> keras.distribution.TensorLayout:
        """The accumulator's layout: rows over the batch axes, then the variable's."""
        axes = (list(getattr(variable_layout, "axes", ()) or ())
                or [None] * len(shape))
        batch = self.axes if len(self.axes) > 1 else self.axes[0]
        distribution = keras.distribution.distribution()
        return keras.distribution.TensorLayout([batch, *axes], distribution.device_mesh)

    def zeros(self, shape, dtype):
        """Empty rows for a variable of `shape` (inside a jitted step)."""
        array = jnp.zeros((self.count, *shape), dtype)
        sharding = jax.sharding.NamedSharding(self.mesh, self.spec(len(shape)))
        return jax.lax.with_sharding_constraint(array, sharding)

    def in_first_row(self, gradient):
        """A whole gradient (reduced already) as rows: itself in row 0, zeros in the
        others (each device writes its own row: nothing moves)."""
        first = jnp.arange(self.count) == 0
        first = first.reshape((self.count,) + (1,) * gradient.ndim)
        return jnp.where(first, gradient[None], jnp.zeros_like(gradient)[None])


def plan(model, options, variables, layouts, follower, own_step) -> DeviceRows | None:
    """The rows the sums keep under the current distribution, or None: no batch axis
    of several devices, a window of one micro-batch (nothing to keep), or a model that
    cannot keep its sums per device (then warned, with why)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    shards = Shards.of_batch()
    if shards.count <= 1:
        return None
    axes = shards.axis if isinstance(shards.axis, tuple) else (shards.axis,)
    described = (f"{type(distribution).__name__} ({shards.count} devices on mesh axis "
                 f"{shards.axis!r})")
    if options.window.constant == 1 and not options.split:
        return None
    why = None
    if own_step is not None:
        why = "the model's own `train_step` computes its gradients itself"
    elif options.privacy is not None:
        why = "DP-SGD clips each example's gradient across the whole micro-batch"
    elif callable(options.nonfinite):
        why = "the `nonfinite` callable reads each micro-batch's whole gradient"
    elif any(getattr(v, "overwrite_with_gradient", False) for v in variables):
        why = "float8 layers keep a measurement of the whole gradient"
    elif follower and list(follower.moving()):
        names = ", ".join(repr(mean.path.rsplit("/", 1)[0])
                          for mean, _ in follower.moving())
        why = f"BatchNormalization layer(s) {names} normalize over all the devices' samples"
    else:
        for variable, layout in zip(variables, layouts):
            used = set()
            for axis in getattr(layout, "axes", ()) or ():
                used |= {axis} if isinstance(axis, str) else set(axis or ())
            if used & set(axes):
                why = (f"the layout {tuple(layout.axes)} of variable {variable.path!r} "
                       f"shards it over the batch axis {shards.axis!r}")
                break
    if why is not None:
        warn(described, why)
        return None
    return DeviceRows(shards.count, axes, shards.mesh, described)


def warn(described: str, why: str) -> None:
    warnings.warn(
        f"gradaccum all-reduces each micro-batch's gradient under {described}: "
        f"{why}, so its sums cannot be kept per device. An update then costs one "
        "gradient all-reduce per micro-batch, as Keras's own step does.",
        stacklevel=3,
    )


class RowView:
    """An accumulator kept in rows, read and written as one sum (its rows added; a
    value assigned goes to row 0): what saving, restoring and the audit see, the
    variable's shape, whatever the number of devices."""

    def __init__(self, variable):
        self.variable = variable
        self.shape = tuple(variable.shape[1:])
        self.dtype = variable.dtype
        self.name = variable.name
        self.path = variable.path

    @property
    def value(self):
        return jnp.sum(self.variable.value, axis=0)

    def numpy(self) -> np.ndarray:
        return np.asarray(self.value)

    def assign(self, value) -> None:
        rows = np.zeros(tuple(self.variable.shape), keras.backend.standardize_dtype(
            self.variable.dtype))
        rows[0] = np.asarray(value)
        self.variable.assign(rows)


def seed_slots(model) -> list[int]:
    """Where the model's seed generators' states sit among its non-trainable
    variables."""
    states = set()
    for layer in model._flatten_layers(include_self=True):
        for generator in getattr(layer, "_seed_generators", ()) or ():
            states.add(id(generator.state))
    return [i for i, v in enumerate(model.non_trainable_variables) if id(v) in states]


def gradients(step, carry, x, y, sample_weight, known, weighted):
    """Keras's step's `gradients` with the sums in rows: each device's share of the
    micro-batch's gradient, stacked `(N, ...)`, and the micro-batch's loss, weight and
    normalizers as one device would have them. Raises `Unsupported` (while tracing)
    where the model's forward pass cannot run per device."""
    from gradaccum.core import transitions as tr

    rows: DeviceRows = step.rows
    model, policy = step.model, step.policy
    axes = rows.axes if len(rows.axes) > 1 else rows.axes[0]
    seeds = step.seed_slots
    trainable, non_trainable = carry.trainable, carry.non_trainable
    metrics, optimizer = carry.metrics, carry.optimizer

    def local(trainable, non_trainable, metrics, optimizer, data):
        x, y, sample_weight = data
        device = jax.lax.axis_index(axes)
        varying = jax.lax.pcast(list(trainable), axes, to="varying")
        non_trainable = list(non_trainable)
        offset = jnp.asarray([_SEED_STRIDE, 0], "uint32") * device.astype("uint32")
        for i in seeds:
            value = non_trainable[i]
            non_trainable[i] = (value.astype("uint32") + offset).astype(value.dtype)

        def objective(trainable):
            step.normalizers.take()
            loss, aux = model.compute_loss_and_updates(
                trainable, non_trainable, metrics, x, y, sample_weight,
                training=True, optimizer_variables=optimizer,
            )
            normalizers = step.normalizers.take()
            if len(normalizers) != 1:
                raise Unsupported(
                    "its loss has several normalized terms" if normalizers else
                    "its loss was computed without a compiled loss to weigh devices by"
                )
            mine = jax.lax.stop_gradient(jnp.asarray(normalizers[0], "float32"))
            total = jax.lax.psum(mine, axes)
            share = jnp.where(total > 0, mine / jnp.where(total > 0, total, 1.0), 0.0)
            if not policy.mean:
                share = jnp.ones_like(share)
            weight = known
            if weight is None:
                weight = tr.weigh(policy, x, y, sample_weight, [total], None,
                                  warn=False)
            # (`tr.loss_factor` without float8 layers: the weight where the step
            # weighs its loss.)
            value = loss * share.astype(loss.dtype)
            if weighted:
                value = value * jnp.asarray(weight).astype(loss.dtype)
            return value, (aux, weight, total, share)

        (_, (aux, weight, total, share)), grads = jax.value_and_grad(
            objective, has_aux=True)(varying)
        unscaled, y_pred, new_non_trainable, new_metrics = aux
        new_non_trainable = list(new_non_trainable)
        for i in seeds:
            value = new_non_trainable[i]
            moved = value.astype("uint32") - offset
            new_non_trainable[i] = jax.lax.pmax(moved, axes).astype(value.dtype)
        for kind, values, references in (
                ("non-trainable", new_non_trainable, model.non_trainable_variables),
                ("metric", new_metrics, model.metrics_variables)):
            for value, reference in zip(values, references):
                if set(jax.typeof(value).mat.varying) & set(rows.axes):
                    raise Unsupported(
                        f"the training step changes {kind} variable "
                        f"{reference.path!r} from each device's samples"
                    )
        loss = (unscaled.astype("float32") * share)[None]
        return ([g[None] for g in grads], loss, y_pred, jnp.asarray(weight), total,
                new_non_trainable, list(new_metrics))

    batch = PartitionSpec(axes)
    whole = PartitionSpec()
    outputs = jax.shard_map(
        local, mesh=rows.mesh,
        in_specs=(whole, whole, whole, whole, batch),
        out_specs=(batch, batch, batch, whole, whole, whole, whole),
        axis_names=set(rows.axes),
    )(list(trainable), list(non_trainable), list(metrics), list(optimizer),
      (x, y, sample_weight))
    grads, losses, y_pred, weight, total, new_non_trainable, new_metrics = outputs
    step.forward_state = list(new_non_trainable)
    step.forward_metrics = list(new_metrics)
    return jnp.sum(losses), y_pred, weight, list(grads), [total], weighted, None
