"""Everything gradaccum does with tf.distribute: the checks and the one reduction.

Under `MirroredStrategy` or `MultiWorkerMirroredStrategy` each replica accumulates
into its own copy of the state (sync-on-read variables) without communicating. At an
update the replicas' sums, weight totals, received counts, the window's count of
skipped shares (the loss scale's one reaction) and the `gradaccum.BatchNormalization`
window statistics (each replica's in its own row) travel in ONE batched all-reduce
(`reduce_window`), and every device forms the same global `G`.
"""

from __future__ import annotations

import tensorflow as tf

from gradaccum.backends.tensorflow.keras_compat import tf_variable

# Replica-local state: each replica adds to its own copy; read across replicas (and
# saved) the copies are summed, or the first replica's is taken for counters that
# every replica keeps alike.
SUMMED = dict(
    trainable=False,
    synchronization=tf.VariableSynchronization.ON_READ,
    aggregation=tf.VariableAggregation.SUM,
)
COUNTED = dict(SUMMED, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def strategy_name(strategy) -> str:
    return type(strategy).__name__.replace("V1", "")


def several_replicas(strategy) -> bool:
    return strategy is not None and strategy.num_replicas_in_sync > 1


def distribution_of(variables):
    """The `tf.distribute.Strategy` that created `variables`, or None.

    Raises:
        ValueError: if the variables come from several strategies, or if they are
            not distributed while the strategy in scope has several replicas (the
            model was built outside `strategy.scope()`), or if they belong to a
            strategy other than the one in scope.
    """
    found = {}
    for variable in variables:
        inner = tf_variable(variable)
        if isinstance(inner, tf.distribute.DistributedValues):
            strategy = inner.distribute_strategy
            found[id(strategy)] = strategy
    current = tf.distribute.get_strategy()
    if not found:
        if current.num_replicas_in_sync > 1:
            raise ValueError(
                "The model's variables must be created inside the scope of the "
                f"distribution strategy in use ({strategy_name(current)} with "
                f"{current.num_replicas_in_sync} replicas). Received: variables created "
                "outside `strategy.scope()`, which the replicas would share. Build the "
                "model and the optimizer inside `with strategy.scope():`, and create "
                "the accumulator (or call `gradaccum.wrap` and `compile`) there too."
            )
        return None
    if len(found) > 1:
        raise ValueError(
            "The variables must all belong to one distribution strategy. Received: "
            f"variables from {len(found)} strategies."
        )
    (strategy,) = found.values()
    if tf.distribute.has_strategy() and current is not strategy:
        raise ValueError(
            "The model's variables belong to another distribution strategy than the "
            f"one in scope. Received: variables of a {strategy_name(strategy)}, "
            f"scope of a {strategy_name(current)}. Use one strategy for the model, "
            "the optimizer and gradaccum."
        )
    return strategy


def check_reduced_dtype(strategy, accumulator_dtype) -> None:
    """Under several replicas the accumulators travel with the float32 (float64)
    weight totals in one batched reduction, whose tensors must share a dtype."""
    if several_replicas(strategy) and accumulator_dtype not in (tf.float32, tf.float64):
        raise ValueError(
            "`accumulator_dtype` must be float32 or float64 under several replicas: "
            "the accumulators travel with the weight totals in one batched "
            "reduction, whose tensors share one dtype. Received: "
            f"accumulator_dtype={accumulator_dtype.name} under "
            f"{strategy_name(strategy)} with {strategy.num_replicas_in_sync} replicas."
        )


def check_replica_context(method: str, variables) -> None:
    """`method` adds a replica's own gradients: under a strategy it must run inside
    `strategy.run`."""
    if not tf.distribute.has_strategy():
        return
    distribution_of(variables)
    if tf.distribute.in_cross_replica_context():
        strategy = tf.distribute.get_strategy()
        raise ValueError(
            f"`{method}` must be called in a replica context under "
            f"{strategy_name(strategy)}: call it inside `strategy.run(...)`, "
            "where each replica adds its own gradients. Received: a call in "
            "cross-replica context."
        )


def reduce_window(strategy, values) -> list:
    """The one communication of a window: the replicas' copies of `values`
    (replica-local variables, or per-replica tensors from `strategy.run` or a
    `merge_call`) summed in one batched all-reduce; returns the global sums (every
    device holds the same values)."""
    reduced = strategy.extended.batch_reduce_to(
        tf.distribute.ReduceOp.SUM, [(v, v) for v in values]
    )
    return [strategy.experimental_local_results(r)[0] for r in reduced]


def first_local(strategy, value):
    """A per-replica value that every replica holds alike, as one tensor."""
    return strategy.experimental_local_results(value)[0]


def check_split_synchronization(strategy, layers, micro_batch_size) -> None:
    """Refuses a synchronized BatchNormalization in split mode under several
    replicas: its all-reduce would sit inside the loop over a batch's micro-batches,
    where the replicas cannot meet (TensorFlow refuses a `merge_call` there)."""
    if not several_replicas(strategy):
        return
    synchronized = [layer.name for layer in layers if getattr(layer, "synchronized", False)]
    if synchronized:
        names = ", ".join(repr(name) for name in synchronized)
        raise ValueError(
            "A BatchNormalization layer with `synchronized=True` cannot train in split "
            "mode under several replicas: its all-reduce would run inside the loop over "
            "a batch's micro-batches, where replicas cannot synchronize. Received: "
            f"micro_batch_size={micro_batch_size!r} under {strategy_name(strategy)} with "
            f"{strategy.num_replicas_in_sync} replicas and layer(s) {names} with "
            "synchronized=True. Pass `steps=` (one micro-batch per training step) "
            "instead, or use synchronized=False."
        )
