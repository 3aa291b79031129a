"""`micro_batch_size="auto"` on JAX: a batch whose step runs out of memory runs again
with smaller micro-batches, and the failed attempt leaves no trace.

The micro-batch size is static on JAX (each size is its own compiled step, made once
and kept), and the step is a pure function of the trainer's state: a failed call
returns nothing, so retrying is calling the next size's step on the same state and
batch. Donation is what could end the retries: a call that fails at run time has
consumed the buffers donated to it. So a size is tried without donating the state
(which costs a second copy of it while the call runs) until the search has settled
on it; from then on the state is donated as Keras donates it. An out-of-memory error
after that (memory taken elsewhere) finds the state consumed and is raised with a
note saying so.
"""

from __future__ import annotations

import jax
import keras

from gradaccum.backends.jax.split_step import Shards
from gradaccum.core.validation import split_batch_size as batch_size

# What XLA's out-of-memory errors say (compiled: RESOURCE_EXHAUSTED; dispatched
# without jit on CPU: INTERNAL ... Out of memory).
OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory")


def compiled(host, step, state, donate: bool = True):
    """`step(state, data)` compiled as Keras compiles a model's train step: jitted
    with the state donated (where `donate`) and, under a distribution, the new
    state laid out as `state` (the trainer's) is (eager where the model runs
    eagerly)."""
    if host.run_eagerly or not host.jit_compile:
        return step
    out_shardings = None
    if keras.distribution.distribution() is not None:
        out_shardings = (None, jax.tree_util.tree_map(lambda a: a.sharding, state))
    return jax.jit(step, donate_argnums=0 if donate else (), out_shardings=out_shardings)


def retrying(accumulation, step_of_size):
    """The step `fit` calls once per batch: the batch through
    `step_of_size(size, donate, state)` with the size `accumulation.auto_size` says, smaller after
    an out-of-memory error."""
    search = accumulation.auto_size

    def step(state, data):
        batch = max(batch_size(data), 1)
        # Under a keras.distribution every size is a multiple of the data's shards.
        search.granule = Shards.of_batch().count
        while True:
            size = min(search.size_for(batch), batch)
            try:
                # Donated only where the search settled on this size.
                donate = search.settled and size == search.chosen
                logs, new_state = step_of_size(size, donate, state)(state, data)
                # An out-of-memory error of the computation surfaces here at the
                # latest, while the batch can still be retried.
                jax.block_until_ready(logs)
            except Exception as error:
                retried = (isinstance(error, jax.errors.JaxRuntimeError)
                           and any(words in str(error) for words in OUT_OF_MEMORY))
                if not retried or size <= search.granule:
                    hand_back(accumulation.host, state)
                if not retried:
                    raise
                if consumed(state):
                    error.add_note(
                        "gradaccum: micro_batch_size='auto' cannot retry this batch: "
                        "the failed step had consumed the training state (donated "
                        "buffers). Give a fixed `micro_batch_size` that fits."
                    )
                    raise
                if size <= search.granule:
                    error.add_note(
                        "gradaccum: micro_batch_size='auto' ran out of memory with "
                        f"micro-batches of {size} sample{'s' if size > 1 else ''}."
                    )
                    raise
                search.failed(size)
                continue
            search.ran(size)
            accumulation.size_chosen()
            return dict(logs, micro_batch_size=float(search.chosen)), new_state

    return step


def hand_back(host, state) -> None:
    """Before an error leaves `fit`: the state the failed call received becomes the
    model's again (Keras syncs the last step's result, which the first batch of a
    fit does not have, into the model's variables as `fit` ends)."""
    if consumed(state):
        return
    names = ("trainable_variables", "non_trainable_variables", "optimizer_variables",
             "metrics_variables")
    host._jax_state = dict(zip(names, state))
    host._jax_state_synced = False


def consumed(state) -> bool:
    """Whether a failed call deleted any of the state's (donated) arrays."""
    return any(
        getattr(leaf, "is_deleted", lambda: False)()
        for leaf in jax.tree_util.tree_leaves(state)
    )
