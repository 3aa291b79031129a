"""Each device's own sums under a keras.distribution on JAX: one all-reduce per update.

Under `DataParallel`, or on the batch axis of `ModelParallel`, each of the N devices
of the batch axis holds a shard of every micro-batch. Left to XLA, the gradient of a
micro-batch is all-reduced across them before it is added to the sums: k all-reduces
per update (`sums="reduced"` keeps that). Here each device differentiates its own
shard of the micro-batch (`jax.shard_map` over the batch axis, the model's other axes
left to XLA) and keeps what it gets (`accumulate`'s `sums` option):

- `"local"` (the default): in its own row of the sums, which have one row per
  device: shape `(N, *variable.shape)`, the rows sharded over the batch axis, so a
  device holds one row, the memory of one sum as before. Nothing crosses devices
  until the window closes, where the rows are added up inside the update's branch:
  one all-reduce per update.
- `"sharded"`: the devices' gradients reduce-scattered into sums of the variable's
  shape sharded over the batch axis (on the largest dimension the variable's layout
  leaves whole that N divides; a variable without one keeps rows), so a device holds
  1/N of them; gathered inside the update's branch.

Why the devices' gradients add up to the one-device gradient: Keras's compiled loss
divides the device's summed loss by its normalizer `n_d` (its samples, or their
weights, or its unmasked tokens); the micro-batch's loss divides the whole sum by
`n = sum(n_d)`. So device d differentiates its loss times `n_d / n`, a scalar
all-reduce of `n_d`. The shares add to 1, so the terms every device adds alike
(weight regularizers) count once.

Dropout and other random layers draw from each device's own seed (the seed state
offset by the device's index), so the devices' masks are independent, as TensorFlow's
replicas and DDP's processes draw theirs (not one device's masks: `sums="reduced"`).

`plan` says, before the state is made, whether a model can keep its sums per device,
and why not (a warning; an error under `sums="sharded"`): a layout that shards a
variable over the batch axis, BatchNormalization (its statistics span the batch),
a model's own `train_step` or `compute_loss`, weighting other than "exact",
reduction "sum", float8 layers, a `nonfinite` callable (it reads the whole gradient),
privacy. What only tracing tells (losses the forward pass computes from the samples,
a loss with several normalized terms, a variable the step changes from the samples)
falls back when the step is traced (`Unsupported`): the micro-batch's gradient is then
reduced as before and added into row 0 (or into the shards), with a warning.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import PartitionSpec

from gradaccum.backends.jax.split_step import Shards
from gradaccum.core import transitions as tr

# Added to a seed's first word times the device's index: a distinct stream per device.
_SEED_STRIDE = 0x9E3779B1


class Unsupported(Exception):
    """Raised while tracing a device's step that cannot be cut per device: why."""


@dataclass(frozen=True)
class DeviceRows:
    """Where the sums sit across the devices of the batch axis.

    Args:
        count: N, the devices the batch is sharded over.
        axes: the mesh axis names of the batch (one, or several together).
        mesh: the JAX mesh.
        described: the distribution and its batch axis, for messages.
        dims: per variable, None where its sums are kept in rows (`sums="local"`,
            or a variable no dimension of which splits over the N devices), else
            the dimension its sums are sharded on (`sums="sharded"`).
        specs: per variable, its layout's axes (None: whole on every device).
    """

    count: int
    axes: tuple
    mesh: jax.sharding.Mesh
    described: str
    dims: tuple
    specs: tuple

    @property
    def batch(self):
        """The batch's mesh axis as a spec names it (several: a tuple)."""
        return self.axes if len(self.axes) > 1 else self.axes[0]

    def layout(self, index: int, shape) -> keras.distribution.TensorLayout:
        """Accumulator `index`'s layout (`spec`) for a variable of `shape`."""
        mesh = keras.distribution.distribution().device_mesh
        return keras.distribution.TensorLayout(list(self.spec(index, len(shape))), mesh)

    def shape(self, index: int, shape) -> tuple:
        """Accumulator `index`'s shape for a variable of `shape`."""
        return tuple(shape) if self.dims[index] is not None else (self.count, *shape)

    def out_spec(self, index: int, ndim: int) -> PartitionSpec:
        """The spec `jax.shard_map` gives device gradient `index` (`ndim`: the
        variable's), as `gradients` returns it: a row, or a shard."""
        dim = self.dims[index]
        if dim is None:
            return PartitionSpec(self.batch)
        return PartitionSpec(*[self.batch if d == dim else None for d in range(ndim)])

    def spec(self, index: int, ndim: int) -> PartitionSpec:
        """Accumulator `index`'s whole spec (`ndim`: its variable's): rows over the
        batch axes then the variable's axes, or the variable's axes with the batch
        axes on its sharded dimension."""
        axes = list(self.specs[index] or (None,) * ndim)
        dim = self.dims[index]
        if dim is None:
            return PartitionSpec(self.batch, *axes)
        axes[dim] = self.batch
        return PartitionSpec(*axes)

    def constrain(self, index: int, total):
        """Accumulator `index`'s sums (rows or shards) held where they belong: left
        to XLA, a `where` over sharded sums may gather them whole and slice them
        again, in every call."""
        ndim = total.ndim - (self.dims[index] is None)
        return jax.lax.with_sharding_constraint(
            total, jax.sharding.NamedSharding(self.mesh, self.spec(index, ndim)))

    def zeros(self, index: int, shape, dtype):
        """Empty sums for accumulator `index` (inside a jitted step)."""
        return self.constrain(index, jnp.zeros(self.shape(index, shape), dtype))

    def whole(self, index: int, total):
        """Accumulator `index`'s sums as one, laid out as its variable: its rows
        added (the update's one all-reduce), or its shards gathered (an
        all-gather). Called in the update's branch, so that nothing but the
        update moves them: left to XLA, a sharded sum would update the weights and
        the optimizer's slots in shards and gather all three after the branch, in
        every call."""
        whole = jnp.sum(total, axis=0) if self.dims[index] is None else total
        spec = self.specs[index] or (None,) * whole.ndim
        return jax.lax.with_sharding_constraint(
            whole, jax.sharding.NamedSharding(self.mesh, PartitionSpec(*spec)))

    def from_whole(self, index: int, gradient):
        """A whole gradient (reduced already) as accumulator `index` holds it:
        itself in row 0, zeros in the others (each device writes its own row:
        nothing moves); a sharded one as it is (each device adds its shard)."""
        if self.dims[index] is not None:
            return gradient
        first = jnp.arange(self.count) == 0
        first = first.reshape((self.count,) + (1,) * gradient.ndim)
        return jnp.where(first, gradient[None], jnp.zeros_like(gradient)[None])


def plan(model, options, variables, layouts, follower, own_step) -> DeviceRows | None:
    """Where the sums sit under the current distribution, or None (reduced in every
    micro-batch, as XLA does it): no batch axis of several devices, a window of one
    micro-batch (nothing to keep), `sums="reduced"`, or a model that cannot keep
    its sums per device (then warned, with why; an error with `sums="sharded"`)."""
    distribution = keras.distribution.distribution()
    if distribution is None or options.sums == "reduced":
        return None
    shards = Shards.of_batch()
    if shards.count <= 1:
        return None
    axes = shards.axis if isinstance(shards.axis, tuple) else (shards.axis,)
    described = (f"{type(distribution).__name__} ({shards.count} devices on mesh axis "
                 f"{shards.axis!r})")
    if options.window.constant == 1 and not options.split and not options.noise_scale:
        # (With the noise scale each device's share is a piece of the window.)
        return None
    why = None
    overridden = [name for name in ("compute_loss", "compute_loss_and_updates")
                  if getattr(type(model), name) is not getattr(keras.Model, name)]
    if own_step is not None:
        why = "the model's own `train_step` computes its gradients itself"
    elif overridden:
        why = (f"the model's own `{overridden[0]}` may compare its samples with each "
               "other or add terms computed from them")
    elif options.weighting != "exact":
        why = (f"weighting={options.weighting!r} leaves each device's share of the "
               'loss unknown (weighting="exact" reads it from the compiled loss)')
    elif options.reduction == "sum":
        why = ('reduction="sum" leaves each device\'s share of the loss unknown (a '
               "summed loss adds up over the devices, a mean one does not)")
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
            if _axes_of(layout) & set(axes):
                why = (f"the layout {tuple(layout.axes)} of variable {variable.path!r} "
                       f"shards it over the batch axis {shards.axis!r}")
                break
    if why is not None:
        if options.sums == "sharded":
            raise ValueError(
                f'`sums="sharded"` needs each device to compute its own share of a '
                f"micro-batch's gradient, which this model cannot under {described}: "
                f'{why}. Received: sums="sharded"; pass sums="local" (each device '
                'keeps whole sums) or sums="reduced".'
            )
        warn(described, why)
        return None
    dims = tuple(
        _shard_dimension(variable, layout, shards.count)
        if options.sums == "sharded" else None
        for variable, layout in zip(variables, layouts))
    specs = tuple(tuple(getattr(layout, "axes", ()) or ()) or None for layout in layouts)
    return DeviceRows(shards.count, axes, shards.mesh, described, dims, specs)


def _axes_of(layout) -> set:
    """The mesh axes a layout shards its variable over."""
    used: set = set()
    for axis in getattr(layout, "axes", ()) or ():
        used |= {axis} if isinstance(axis, str) else set(axis or ())
    return used


def _shard_dimension(variable, layout, count: int) -> int | None:
    """The dimension a variable's sums are sharded on over `count` devices: the
    largest one its layout leaves whole that divides by `count` (None: kept in rows,
    as a bias of a size no device count divides)."""
    axes = list(getattr(layout, "axes", ()) or ()) or [None] * len(variable.shape)
    fits = [(size, d) for d, (size, axis) in enumerate(zip(variable.shape, axes))
            if axis is None and size % count == 0]
    return max(fits)[1] if fits else None


def warn(described: str, why: str, sharded: bool = False) -> None:
    """Says why each micro-batch's gradient is all-reduced (`sharded`: the sums
    stay sharded, as they were laid out before the step was traced)."""
    then = ("so the devices cannot reduce-scatter their own gradients. The sums stay "
            "sharded (1/N on each device); an update costs one gradient all-reduce per "
            "micro-batch." if sharded else
            "so its sums cannot be kept per device. An update then costs one gradient "
            "all-reduce per micro-batch, as Keras's own step does.")
    warnings.warn(f"gradaccum all-reduces each micro-batch's gradient under "
                  f"{described}: {why}, {then}", stacklevel=3)


class SumView:
    """An accumulator kept per device, read and written as one whole sum, replicated
    (its rows added, or its shards gathered; a value assigned goes to row 0, or is
    laid out in shards): what saving, restoring and the audit see, the variable's
    shape, whatever the number of devices or processes.

    Args:
        variable: the accumulator.
        rows: whether it holds rows (else shards).
        mesh: the JAX mesh.
    """

    def __init__(self, variable, rows: bool, mesh):
        self.variable = variable
        self.rows = rows
        self.shape = tuple(variable.shape[1:] if rows else variable.shape)
        self.dtype = variable.dtype
        self.name = variable.name
        self.path = variable.path
        self.mesh = mesh

    @property
    def value(self):
        # (Every process computes it, as every process saves: under several
        # processes the sum spans devices no process addresses alone.)
        return _whole(self.rows, self.mesh)(self.variable.value)

    def numpy(self) -> np.ndarray:
        return np.asarray(self.value)

    def assign(self, value) -> None:
        value = np.asarray(value)
        if self.rows:
            rows = np.zeros(tuple(self.variable.shape), value.dtype)
            rows[0] = value
            value = rows
        self.variable.assign(value)


@functools.cache
def _whole(rows: bool, mesh):
    """The jitted read of a `SumView`: rows added, or shards gathered, replicated
    on `mesh`."""
    return jax.jit(
        (lambda value: jnp.sum(value, axis=0)) if rows else (lambda value: value),
        out_shardings=jax.sharding.NamedSharding(mesh, PartitionSpec()))


def seed_slots(model) -> list[int]:
    """Where the model's seed generators' states sit among its non-trainable
    variables."""
    states = set()
    for layer in model._flatten_layers(include_self=True):
        for generator in getattr(layer, "_seed_generators", ()) or ():
            states.add(id(generator.state))
    return [i for i, v in enumerate(model.non_trainable_variables) if id(v) in states]


def gradients(step, carry, x, y, sample_weight, weighted):
    """Keras's step's `gradients` with the sums kept per device: each device's
    share of the micro-batch's gradient as its accumulator holds it (a row of
    `(N, ...)`, or its shard of the devices' sum: a reduce-scatter), and the
    micro-batch's loss, weight and normalizers as one device would have them.
    Raises `Unsupported` (while tracing) where the model's step cannot be cut per
    device."""
    rows: DeviceRows = step.rows
    model = step.model
    axes = rows.batch
    seeds = step.seed_slots
    trainable, non_trainable = carry.trainable, carry.non_trainable
    metrics, optimizer = carry.metrics, carry.optimizer
    options = {"training": True} if model._call_has_training_arg else {}

    def local(trainable, non_trainable, metrics, optimizer_variables, data):
        x, y, sample_weight = data
        device = jax.lax.axis_index(axes)
        varying = jax.lax.pcast(list(trainable), axes, to="varying")
        drawn = list(non_trainable)
        offset = jnp.asarray([_SEED_STRIDE, 0], "uint32") * device.astype("uint32")
        for i in seeds:
            drawn[i] = (drawn[i].astype("uint32") + offset).astype(drawn[i].dtype)

        def objective(weights):
            # Keras's `compute_loss_and_updates`, with the forward pass's own
            # losses checked: a term computed from the samples (an activity
            # regularizer, `add_loss`) may be a mean or a sum over them, which
            # no share of it makes the large batch's.
            y_pred, moved, losses = model.stateless_call(
                weights, drawn, x, return_losses=True, **options)
            if losses:
                _, _, probed = model.stateless_call(
                    trainable, non_trainable, x, return_losses=True, **options)
                if any(_varies(term, rows) for term in probed):
                    raise Unsupported(
                        "its forward pass adds losses computed from the samples "
                        "(an activity regularizer, `add_loss`)")
                model._losses_override.clear()
                model._losses_override = losses
            step.normalizers.take()
            try:
                loss, (_, moved, updated) = model.stateless_compute_loss(
                    weights, moved, metrics, x=x, y=y, y_pred=y_pred,
                    sample_weight=sample_weight, training=True)
            finally:
                if losses:
                    model._losses_override.clear()
            normalizers = step.normalizers.take()
            if len(normalizers) != 1:
                raise Unsupported(
                    "its loss has several normalized terms" if normalizers else
                    "its loss was computed without a compiled loss to weigh devices by")
            unscaled = loss
            mapping = list(zip(model.optimizer.variables, optimizer_variables))
            with keras.StatelessScope(state_mapping=mapping):
                loss = model.optimizer.scale_loss(loss)
            # Device d's loss divides by its normalizer n_d; the micro-batch's by
            # their sum n: d's share is n_d / n, and terms every device adds alike
            # (weight regularizers) count once.
            mine = jax.lax.stop_gradient(jnp.asarray(normalizers[0], "float32"))
            total = jax.lax.psum(mine, axes)
            share = jnp.where(total > 0, mine / jnp.where(total > 0, total, 1.0), 0.0)
            # (`tr.loss_factor` without float8 layers: the micro-batch's weight, n,
            # where the step weighs its loss.)
            value = loss * share.astype(loss.dtype)
            if weighted:
                value = value * total.astype(loss.dtype)
            return value, (unscaled, y_pred, moved, updated, total, share)

        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(varying)
        unscaled, y_pred, moved, updated, total, share = aux
        moved = list(moved)
        for i in seeds:
            # Every device drew as many numbers: its seed moved as the others'.
            back = moved[i].astype("uint32") - offset
            moved[i] = jax.lax.pmax(back, axes).astype(moved[i].dtype)
        for kind, values, references in (
                ("non-trainable", moved, model.non_trainable_variables),
                ("metric", updated, model.metrics_variables)):
            for value, reference in zip(values, references):
                if _varies(value, rows):
                    raise Unsupported(
                        f"the training step changes {kind} variable "
                        f"{reference.path!r} from each device's samples")
        loss = (unscaled.astype("float32") * share)[None]
        # The noise scale's pieces: each device's share of weight w_d (its
        # normalizer) and n_d samples (`noise_scale.add_piece`).
        pieces = jnp.zeros((5,))
        if noise:
            squared = sum(jnp.sum(jnp.square(g.astype("float32"))) for g in grads)
            mine = jnp.asarray(total * share, "float32")
            safe = jnp.where(mine > 0, mine, 1.0)
            samples = jnp.asarray(tr.samples(x), "float32")
            pieces = jax.lax.psum(jnp.where(mine > 0, jnp.stack([
                squared / safe, safe / samples, safe * safe / samples, 1.0, safe]), 0.0),
                axes)
        held = [g[None] if dim is None else
                jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
                for g, dim in zip(grads, rows.dims)]
        return held, loss, y_pred, total, moved, list(updated), pieces

    batch = PartitionSpec(axes)
    whole = PartitionSpec()
    noise = "noise_pieces_norm" in carry.fields
    held, losses, y_pred, total, moved, updated, pieces = jax.shard_map(
        local, mesh=rows.mesh,
        in_specs=(whole, whole, whole, whole, batch),
        out_specs=([rows.out_spec(i, len(v.shape)) for i, v in enumerate(trainable)],
                   batch, batch, whole, whole, whole, whole),
        axis_names=set(rows.axes),
    )(list(trainable), list(non_trainable), list(metrics), list(optimizer),
      (x, y, sample_weight))
    step.forward_state = list(moved)
    step.forward_metrics = list(updated)
    step.noise_pieces = list(pieces) if noise else None
    return jnp.sum(losses), y_pred, total, list(held), [total], weighted, None


def _varies(value, rows: DeviceRows) -> bool:
    """Whether a traced value inside `gradients`' `shard_map` differs from device to
    device of the batch axis (it was computed from the device's samples)."""
    return bool(set(jax.typeof(value).mat.varying) & set(rows.axes))
