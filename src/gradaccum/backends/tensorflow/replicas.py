"""Closing a window under a tf.distribute strategy: every replica holds its share of
the window's sums; one reduction (`distributed.reduce_window`) gathers the sums, the
weights, the received counts, the skipped shares and the batch normalization windows,
and one optimizer update applies the global window on every replica.

`ReplicaRecord` is the window record of `gradaccum.core.transitions` there: fields
and sums as on one device, but its `close` meets the replicas (a `merge_call`: they
cannot synchronize inside a `tf.cond` of a replica function, keras issue 20582), and
while it closes, the window's sums, total weight and received counts it reads are
the global window's.
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum.backends.tensorflow import batch_norm
from gradaccum.backends.tensorflow import distributed as dist
from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow.record import VariableRecord
from gradaccum.core import loss_scaling
from gradaccum.core import transitions as tr
from gradaccum.core.state import NOISE_PIECES as PIECES


class ReplicaRecord(VariableRecord):
    """A `GradientAccumulator`'s window record under a strategy of several
    replicas (see the module)."""

    def __init__(self, accumulator, optimizer=None):
        super().__init__(accumulator, optimizer)
        # Every replica's skipped shares are counted at the update, and the loss
        # scale reacts there once for the window.
        self.counts_skips = False
        self.reacts_now = False
        # The global window while the record closes.
        self.reduced = None

    def get(self, name: str):
        if self.reduced is not None and name in self.reduced:
            return self.reduced[name]
        return super().get(name)

    def window_weight(self):
        weight = self.get("total_weight")
        if tf.distribute.in_cross_replica_context():
            return weight  # a sync-on-read variable reads the replicas' sum here
        # The budget is the global window's: every replica decides alike (one
        # scalar all-reduce per micro-batch).
        return tf.distribute.get_replica_context().all_reduce("sum", weight)

    def sums(self) -> list:
        if self.reduced is not None:
            return list(self.reduced["sums"])
        return super().sums()

    def close(self, apply, close, update, finish, empty_sums=True):
        strategy = tf.distribute.get_strategy()
        dist.distribution_of(self.accumulator.target_variables)
        # An empty window closes without meeting anyone.
        close = tf.logical_and(tf.cast(close, tf.bool), tr.window_length(self) > 0)
        apply = tf.cast(apply, tf.bool)
        if tf.distribute.in_cross_replica_context():
            # Outside `strategy.run` (closing a window at the end of the data).
            window = strategy.run(self.replica_window)
            return self._close(strategy, apply, close, window, update, finish, empty_sums)
        # The replicas meet on every call, which costs no communication; the
        # condition is taken in cross-replica context.
        return tf.distribute.get_replica_context().merge_call(
            lambda strategy, *args: self._close(strategy, *args, update, finish, empty_sums),
            args=(apply, close, self.replica_window()),
        )

    def replica_window(self):
        """What a replica adds to the window's reduction besides its sums: how many
        of its shares were skipped (the loss scale's one reaction), and (with driven
        batch normalization layers) each layer's window statistics in this
        replica's slot."""
        state = self.state
        dtype = state.total_weight.dtype
        window = [tf.cast(tf.reshape(state.window_skipped, [1]), dtype)]
        layers = self.accumulator.batch_normalization_layers
        context = tf.distribute.get_replica_context()
        replica, replicas = context.replica_id_in_sync_group, context.num_replicas_in_sync
        if layers:
            window.append(tf.concat(
                [layer._replica_slots(replica, replicas, dtype) for layer in layers], axis=0
            ))
        kept = self._kept_values()
        if kept:
            # The window's `overwrite_with_gradient` values in this replica's row of a
            # zero block: summed, the reduction gathers every replica's, whose
            # elementwise maximum the update takes.
            row = tf.concat([tf.reshape(tf.cast(v, dtype), [-1]) for v in kept], axis=0)
            slot = tf.one_hot(replica, replicas, dtype=dtype)
            window.append(tf.reshape(slot[:, None] * row[None, :], [-1]))
        return window

    def _kept_values(self) -> list:
        """The accumulators that keep `overwrite_with_gradient` values."""
        return [acc for acc, flag in zip(self.state.accumulators, self.overwrites) if flag]

    def _close(self, strategy, apply, close, window, update, finish, empty_sums):
        """In cross-replica context: the window closes when `close` (alike on every
        replica); it applies when `apply` and a replica accepted a share of it,
        after the one reduction; a window that does not apply is emptied without
        one."""
        apply = dist.first_local(strategy, apply)

        def closing():
            if self.optimizer is None or tf.get_static_value(apply) is False:
                # Nothing to apply (a window the data ends in, dropped): no reduction.
                return discard()
            return tf.cond(apply, lambda: self._reduce_and_close(
                strategy, window, update, finish, empty_sums), discard)

        def discard():
            finish(tf.constant(False))
            if empty_sums:
                self.empty_sums()
            return tf.constant(False)

        return tf.cond(dist.first_local(strategy, close), closing, lambda: tf.constant(False))

    def _reduce_and_close(self, strategy, window, update, finish, empty_sums):
        state = self.state
        accumulator = self.accumulator
        n = len(state.accumulators)
        # With the noise scale, the replicas' pieces (each replica's share of each
        # micro-batch is one) join the reduction.
        noise = [getattr(state, name) for name in PIECES if self.has(name)]
        reduced = dist.reduce_window(
            strategy, [*state.accumulators, state.total_weight, state.received,
                       *noise,
                       *window]
        )
        sums, (total_weight, received) = reduced[:n], reduced[n:n + 2]
        pieces = dict(zip(PIECES, reduced[n + 2:n + 2 + len(noise)]))
        skipped = reduced[n + 2 + len(noise)][0]
        self.pooled = None
        extra = list(reduced[n + 3 + len(noise):])
        layers, replicas = accumulator.batch_normalization_layers, strategy.num_replicas_in_sync
        if layers:
            # Each driven batch normalization layer's replicas' windows, pooled.
            sizes = [layer._replica_slots_size(replicas) for layer in layers]
            self.pooled = [
                batch_norm.pool_replicas(gathered, replicas)
                for gathered in tf.split(extra.pop(0), sizes)
            ]
        if self._kept_values():
            sums = self._replicas_maxima(sums, extra.pop(0), replicas)
        self.reduced = {"sums": sums, "total_weight": total_weight, "received": received,
                        **pieces}
        micro_batches = tr.window_length(self)
        # Every replica's skipped shares, in the one count every replica keeps.
        state.skipped.assign(state.skipped + tf.cast(skipped, state.skipped.dtype))
        # Something to apply: a variable received a gradient in the window (read
        # from the summed counts, which a checkpoint restores exactly).
        accepted = tf.reduce_any(received > 0)
        inner = self.optimizer
        if kc.is_loss_scale_optimizer(inner):
            inner = inner.inner_optimizer

        def run():
            with kc.applying_across_replicas(inner, strategy):
                update()
            return tf.constant(True)

        applied = tf.cond(accepted, run, lambda: tf.constant(False))
        with tf.control_dependencies([applied]):
            finish(applied)
            if empty_sums:
                self.empty_sums()
        loss_scaling = accumulator._loss_scaling.value
        if kc.is_loss_scale_optimizer(self.optimizer):
            loss_scaling = self.optimizer
        if loss_scaling is not None:
            # The scale the window's shares were scaled with reacts once (also when
            # the caller applies with the inner optimizer).
            with tf.control_dependencies([applied]):
                settle_loss_scale(loss_scaling, skipped > 0, micro_batches)
        self.reduced = None
        return tf.identity(applied)

    def _replicas_maxima(self, sums, gathered, replicas: int) -> list:
        """`sums` with each `overwrite_with_gradient` entry the elementwise maximum
        of the replicas' values (gathered, a row per replica), over the replicas
        whose share of the window held an accepted micro-batch."""
        rows = tf.reshape(gathered, [replicas, -1])
        flags = list(self.overwrites)
        kept = [acc for acc, flag in zip(self.state.accumulators, flags) if flag]
        sizes = [int(acc.shape.num_elements()) for acc in kept]
        maxima = iter(tf.split(tf.reduce_max(rows, axis=0), sizes))
        return [tf.cast(tf.reshape(next(maxima), acc.shape), acc.dtype) if flag else total
                for total, acc, flag in zip(sums, self.state.accumulators, flags)]

    def apply(self, gradients, pooled=None) -> None:
        super().apply(gradients, self.pooled if pooled is None else pooled)


def settle_loss_scale(optimizer, overflowed, micro_batches) -> None:
    """The loss scale's one reaction to a window under a strategy (in cross-replica
    context, so every replica's copy changes alike): if any replica's share
    overflowed, it backs off once, as Keras's does for a step with a non-finite
    gradient; else the window's `micro_batches` count as that many finite steps."""
    counter = tf.convert_to_tensor(optimizer.step_counter)
    scale = tf.convert_to_tensor(optimizer.dynamic_scale)
    grown = loss_scaling.grown_by(counter, scale, micro_batches,
                                  int(optimizer.dynamic_growth_steps))
    backed = loss_scaling.backed_off(counter, scale)
    optimizer.step_counter.assign(tf.where(overflowed, backed[0], grown[0]))
    optimizer.dynamic_scale.assign(tf.where(overflowed, backed[1], grown[1]))
