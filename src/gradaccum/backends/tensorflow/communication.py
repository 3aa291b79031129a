"""Counting what crosses between replicas: cross-device ops that keep a tally.

`CountingCrossDeviceOps` wraps the cross-device ops a `MirroredStrategy` uses and
counts, as they execute (inside compiled functions too), the reductions made through
them, the tensors they carry and their bytes. It is how gradaccum's tests and
benchmarks check that an update costs one reduction whatever `steps` is.
"""

from __future__ import annotations

from typing import Any

from gradaccum._tf import require_tensorflow

require_tensorflow()

import tensorflow as tf  # noqa: E402


def _payload_bytes(values: list) -> int:
    total = 0
    for value in values:
        component = value.values[0] if hasattr(value, "values") else value
        total += component.shape.num_elements() * tf.as_dtype(component.dtype).size
    return total


class CountingCrossDeviceOps(tf.distribute.CrossDeviceOps):
    """Cross-device ops that count the reductions they perform.

    Pass it as `tf.distribute.MirroredStrategy(devices, cross_device_ops=...)`. The
    counters are variables updated by the reduction itself, so a reduction inside a
    `tf.function` or a `tf.cond` branch counts each time it runs and not when traced.
    Bytes are the reduced payload (one replica's share); a ring all-reduce moves about
    `2 (R - 1) / R` times that per replica. Reductions that a strategy routes around
    its cross-device ops (MirroredStrategy reduces single values bound for the host,
    such as Keras's logged metrics, with its own host reduction) are not seen.

    Args:
        inner: the cross-device ops doing the work
            (default `tf.distribute.ReductionToOneDevice()`).

    Examples:

        >>> import tensorflow as tf, gradaccum
        >>> cpu = tf.config.list_physical_devices("CPU")[0]
        >>> try:  # two logical CPUs stand in for two accelerators
        ...     tf.config.set_logical_device_configuration(
        ...         cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        ... except RuntimeError:
        ...     pass  # TensorFlow has started: keep its devices
        >>> ops = gradaccum.CountingCrossDeviceOps()
        >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
        ...                                           cross_device_ops=ops)
        >>> with strategy.scope():
        ...     v = tf.Variable(tf.zeros(4), synchronization=tf.VariableSynchronization.ON_READ,
        ...                     aggregation=tf.VariableAggregation.SUM)
        >>> total = strategy.extended.batch_reduce_to("SUM", [(v, v)])
        >>> int(ops.reductions), int(ops.tensors), int(ops.bytes)
        (1, 1, 16)
    """

    def __init__(self, inner: tf.distribute.CrossDeviceOps | None = None) -> None:
        if inner is not None and not isinstance(inner, tf.distribute.CrossDeviceOps):
            raise ValueError(
                "`inner` must be a tf.distribute.CrossDeviceOps. "
                f"Received: inner of type {type(inner).__name__}"
            )
        super().__init__()
        self._inner = inner if inner is not None else tf.distribute.ReductionToOneDevice()
        with tf.init_scope():
            int64 = dict(dtype=tf.int64, trainable=False)
            self.reductions = tf.Variable(0, name="reductions", **int64)
            self.tensors = tf.Variable(0, name="tensors", **int64)
            self.bytes = tf.Variable(0, name="bytes", **int64)

    def reset(self) -> None:
        """Sets the three counters to zero."""
        for counter in (self.reductions, self.tensors, self.bytes):
            counter.assign(0)

    def _count(self, values: list) -> None:
        self.reductions.assign_add(1)
        self.tensors.assign_add(len(values))
        self.bytes.assign_add(_payload_bytes(values))

    def reduce_implementation(self, reduce_op: Any, per_replica_value: Any, destinations: Any,
                              options: Any) -> Any:
        self._count([per_replica_value])
        return self._inner.reduce_implementation(
            reduce_op, per_replica_value, destinations, options
        )

    def batch_reduce_implementation(self, reduce_op: Any, value_destination_pairs: Any,
                                    options: Any) -> Any:
        self._count([value for value, _ in value_destination_pairs])
        return self._inner.batch_reduce_implementation(
            reduce_op, value_destination_pairs, options
        )

    def broadcast_implementation(self, tensor: Any, destinations: Any) -> Any:
        return self._inner.broadcast_implementation(tensor, destinations)
