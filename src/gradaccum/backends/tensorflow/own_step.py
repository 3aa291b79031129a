"""A model's own `train_step` on TensorFlow, run unchanged: gradaccum sits where the
step hands gradients to an optimizer (`apply_gradients`, which calls `apply`).

While any replica is inside the step, each optimizer attribute of the model has its
`apply` routed to an accumulator: one per (optimizer, variable list, call in the step),
each applied with its optimizer once per window. gradaccum's own updates go past the
route (`keras_compat.apply_gradients`).
"""

from __future__ import annotations

import contextlib
import threading

import keras
import tensorflow as tf

from gradaccum._keras_common import UnroutedUpdates
from gradaccum.backends.tensorflow import batch_norm, following
from gradaccum.backends.tensorflow import keras_compat as kc
from gradaccum.backends.tensorflow import logs as _logs
from gradaccum.core import transitions as tr


def _scaled(gradient, factor):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def _all_accepted(outcomes):
    """Whether every optimizer call of a step accepted its micro-batch (None: the
    step made none)."""
    if not outcomes:
        return None
    return tf.reduce_all(tf.stack([tf.convert_to_tensor(o.accepted) for o in outcomes]))


class OwnStep:
    """Runs a model's own `train_step` with its optimizer calls accumulated.

    Args:
        accumulation: the `fit.Accumulation` of the model being trained.
    """

    def __init__(self, accumulation):
        self._accumulation = accumulation
        # Per thread: MirroredStrategy runs each replica's step in a thread of its
        # own (the micro-batch in training, what its step handed over).
        self._local = threading.local()
        # The optimizers' `apply` is routed while any replica is in its step.
        self._lock = threading.Lock()
        self._routed = []
        self._users = 0
        # An optimizer the step applies that is not routed is warned of.
        self._unrouted = UnroutedUpdates()
        self._watching = contextlib.ExitStack()
        # The optimizers the step handed gradients to, in order.
        self.handed = []
        # The optimizers the traced step applied more than once per batch to the
        # same variables: (the model's attribute, calls per batch).
        self.repeated = []
        # Optimizer calls whose gradients the step computed from variables an
        # earlier call of the same step updates: (later, earlier) optimizers. On one
        # large batch those gradients would see the update (a GAN in keras.io's
        # DCGAN order); accumulated, they are taken at the window's first weights.
        self.stale = []

    def run(self, own_step, data):
        """`own_step(data)` (the model's bound `train_step`) with its optimizer calls
        accumulated; returns its logs."""
        accumulation = self._accumulation
        host, state = accumulation.host, accumulation.state
        if not accumulation.options.split:
            state.epoch_step.assign_add(1)
        local = self._local
        local.micro_batch = keras.utils.unpack_x_y_sample_weight(data)
        accumulation.normalizers.start()
        local.intercepted = 0
        local.calls_in_step = {}
        local.calls = []
        local.updated = []
        local.outcomes = []
        layers = state.own[0][0].batch_normalization_layers if state.own else []
        start = following.begin(accumulation)

        def step():
            self._route([optimizer for _, optimizer in kc.named_optimizers(host)])
            try:
                with batch_norm.driving(layers), accumulation.follower.observing():
                    return own_step(data)
            finally:
                self._end_route()

        # The step's own trackers leave out a micro-batch any of its optimizers
        # skipped, as Keras's step's do.
        logs = _logs.tracked(accumulation, step, lambda: _all_accepted(local.outcomes),
                             own=True)
        local.micro_batch = None
        if local.outcomes:
            # The moving statistics follow the first optimizer's window (every
            # optimizer's saw the same micro-batches), taking the micro-batch where
            # any accepted it.
            first = local.outcomes[0]
            accepted = tf.reduce_any(tf.stack([tf.convert_to_tensor(o.accepted)
                                               for o in local.outcomes]))
            following.end(accumulation, start, first._replace(accepted=accepted))
        self._note_repeats(host, local.calls)
        if not local.intercepted:
            raise ValueError(
                f"The train_step of {type(host).__name__} must hand its gradients to an "
                "optimizer of the model (`self.optimizer.apply_gradients(...)` or "
                "`.apply(...)`) for gradaccum to accumulate them. Received: a step "
                "that called neither on any optimizer attribute of the model, so "
                "nothing would be trained."
            )
        return logs

    def _note_repeats(self, host, calls) -> None:
        """Records the optimizers the step (being traced) applied several times per
        batch to variables those calls share (the same list, or lists that overlap),
        for `repeat_warning`. `calls`: `(optimizer, variable ids)` per call."""
        for optimizer in {id(o): o for o, _ in calls}.values():
            mine = [variables for o, variables in calls if o is optimizer]
            count = len(mine)
            if not any(mine[i] & mine[j] for i in range(count) for j in range(i)):
                continue
            name = kc.optimizer_name(host, optimizer)
            if (name, count) not in self.repeated:
                self.repeated.append((name, count))

    def _note_stale(self, optimizer, grads, variables) -> None:
        """While the step is traced: whether `grads` were computed, after an earlier
        optimizer call of this step, from variables that call updates (ops created
        after it that read them). Then records `(optimizer, earlier optimizer)` in
        `stale`."""
        local = self._local
        graph = tf.compat.v1.get_default_graph()
        nodes = getattr(graph, "_nodes_by_id", None)
        if tf.executing_eagerly() or nodes is None or not hasattr(graph, "captures"):
            return
        for earlier, after, updated in local.updated:
            reads = {id(_handle(v)) for v in updated}
            if _reads_after(grads, after, reads):
                pair = (optimizer, earlier)
                if all(p[0] is not optimizer or p[1] is not earlier for p in self.stale):
                    self.stale.append(pair)
        last = max(nodes, default=0)
        local.updated.append((optimizer, last, list(variables)))

    def repeat_warning(self) -> str | None:
        """What fit warns about, once per fit, when the model's step applies an
        optimizer several times per batch (None: it does not)."""
        if not self.repeated:
            return None
        host = self._accumulation.host
        name, count = self.repeated[0]
        return (
            f"{type(host).__name__}.train_step applies `self.{name}` {count} times per "
            "batch to the same variables. gradaccum gives each call its own "
            f"accumulator: a window makes {count} updates with it, each from the "
            "gradients its call took at the weights the window started from. "
            "Training on the window as one batch would compute each call's gradients "
            "after the previous update, so the results differ (a WGAN critic trained "
            "several times per step: train it once per batch and let more batches "
            "reach it instead)."
        )

    def _route(self, optimizers) -> None:
        """Routes each optimizer's `apply` (which `apply_gradients` calls) to the
        accumulators, while any replica is inside its step."""
        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            self._watching.enter_context(self._unrouted.watching(
                optimizers, type(self._accumulation.host).__name__))
            for optimizer in optimizers:
                self._routed.append(
                    (optimizer, "apply" in optimizer.__dict__, optimizer.__dict__.get("apply"))
                )

                def apply(grads, trainable_variables=None, *, _opt=optimizer):
                    return self._accumulate(_opt, grads, trainable_variables)

                optimizer.apply = apply

    def _end_route(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users:
                return
            for optimizer, had, value in self._routed:
                if had:
                    optimizer.apply = value
                else:
                    del optimizer.apply
            self._routed = []
            self._watching.close()

    def _accumulate(self, optimizer, grads, trainable_variables):
        """What an optimizer's `apply` does inside the step: the micro-batch's
        gradients go to their accumulator, which applies when its window is due."""
        accumulation = self._accumulation
        local = self._local
        local.intercepted += 1
        if all(optimizer is not other for other in self.handed):
            self.handed.append(optimizer)
        grads = list(grads)
        if trainable_variables is None:
            trainable_variables = kc.optimizer_variables_of(optimizer)
        variables = list(trainable_variables)
        # A step that hands the same variables to the same optimizer twice makes
        # two updates per batch: one accumulator per call, each once per window.
        key = (id(optimizer), tuple(id(v) for v in variables))
        occurrence = local.calls_in_step.get(key, 0)
        local.calls_in_step[key] = occurrence + 1
        local.calls.append((optimizer, frozenset(id(v) for v in variables)))
        self._note_stale(optimizer, grads, variables)
        acc = self.accumulator(optimizer, variables, occurrence)
        x, y, sample_weight = local.micro_batch
        split = accumulation.options.split
        # In split mode the batch's step applies once its micro-batches are in.
        record = acc._record(None if split else optimizer)
        normalizers = accumulation.normalizers.since_last_call()
        weight = tr.weigh(accumulation.policy, x, y, sample_weight, normalizers, record,
                          warn=False)
        tr.track_terms(accumulation.fit_record(), record, normalizers)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1 and accumulation.options.reduction == "mean":
            # Keras's losses divide a replica's loss by the replica count (its
            # optimizer then sums the replicas): undone, so that the weighted
            # window is the global window's gradient. Reduction "sum" sums the
            # replicas' gradients as Keras's optimizer does: kept.
            grads = [_scaled(g, replicas) for g in grads]
        acc._run(
            grads, weight, weighted=False,
            loss_scale_optimizer=optimizer if kc.is_loss_scale_optimizer(optimizer) else None,
            optimizer=None if split else optimizer, policy=accumulation.policy,
            end=None if split else tr.end_of_data(accumulation.fit_record()),
            fit=accumulation.fit_record(), record=record,
        )
        local.outcomes.append(record.outcome)
        return optimizer.iterations

    def accumulator(self, optimizer, variables, occurrence=0):
        """The accumulator of `optimizer` and `variables` (the `occurrence`-th call
        in the step with both), made the first time it is asked for."""
        found = self._find(optimizer, variables, occurrence)
        if found is not None:
            return found
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            # A replica cannot create the strategy's variables (a GAN's second
            # optimizer, met in the traced step): the replicas, which trace the same
            # step, meet here and one cross-replica call makes the accumulator.
            tf.distribute.get_replica_context().merge_call(
                lambda _: self._find(optimizer, variables, occurrence)
                or self._new(optimizer, variables)
            )
            return self._find(optimizer, variables, occurrence)
        return self._new(optimizer, variables)

    def _find(self, optimizer, variables, occurrence):
        for acc, owner in self._accumulation.state.own:
            if owner is optimizer and len(acc.target_variables) == len(variables) and all(
                a is b for a, b in zip(acc.target_variables, variables)
            ):
                if occurrence == 0:
                    return acc
                occurrence -= 1
        return None

    def _new(self, optimizer, variables):
        accumulation = self._accumulation
        state = accumulation.state
        layers = accumulation.layers if not state.own else None
        name = f"gradaccum_own_{len(state.own)}"
        if not state.own:
            # The model's first step built it: what `check_trainable` checks of
            # float8's variables, once.
            accumulation.check_overwrites()
        # Made (and given any restored values) outside the step being traced, once.
        with tf.init_scope():
            acc = accumulation.new_accumulator(variables, layers=layers, name=name)
            for layer in acc.batch_normalization_layers:
                layer._accumulated = False
            state.own.append((acc, optimizer))
            accumulation.restore_pending()
        return acc


def _handle(variable):
    """The resource handle of a Keras or TensorFlow variable."""
    value = getattr(variable, "value", variable)
    return getattr(value, "handle", value)


def _outermost(tensor):
    """The tensor a function graph's captured placeholder stands for, through every
    enclosing function graph (a variable's eager handle, for a variable read)."""
    graph = tensor.graph
    while hasattr(graph, "captures"):
        outer = next((external for external, internal in graph.captures
                      if internal is tensor), None)
        if outer is None:
            return tensor
        tensor = outer
        graph = getattr(tensor, "graph", None)
        if graph is None:
            return tensor
    return tensor


def _reads_after(tensors, mark: int, handles: set) -> bool:
    """Whether an op created after op id `mark` that reads a variable whose handle
    is in `handles` (ids of eager handles) leads to any of `tensors`."""
    stack = [getattr(t, "values", t) for t in tensors if t is not None]
    stack = [t.op for t in stack if hasattr(t, "op")]
    seen = set()
    while stack:
        op = stack.pop()
        if op._id in seen or op._id <= mark:
            continue
        seen.add(op._id)
        if op.type in ("ReadVariableOp", "ResourceGather", "ResourceGatherNd") and (
            id(_outermost(op.inputs[0])) in handles
        ):
            return True
        stack += [t.op for t in op.inputs]
        stack += list(op.control_inputs)
    return False
