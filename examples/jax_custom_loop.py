"""JAX: a custom training loop with gradaccum's GradientAccumulator.

For Keras's JAX backend (it sets `KERAS_BACKEND` itself). For TensorFlow see
`custom_loop.py`, for PyTorch `torch_custom_loop.py`.

The loop is keras.io's "Writing a training loop from scratch in JAX": the state is
arrays (`model.stateless_call`, `jax.value_and_grad`, `optimizer.stateless_apply`),
passed through one jitted step. The accumulator's state travels with them, and
`acc.stateless_step` replaces `optimizer.stateless_apply`: micro-batches of unequal
size (16, 16, 8) make one update per window of 40 samples, equal to one step on the
whole window, and the last window of the data (a partial one) is flushed. It
prints the largest gap between its weights and those of Keras's own step on each
window as one large batch: float rounding.

    python examples/jax_custom_loop.py
"""

import os

os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import gradaccum  # noqa: E402


def make_model():
    return keras.Sequential(
        [keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
         keras.layers.Dense(4)]
    )


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(420, 20)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    model, optimizer = make_model(), keras.optimizers.Adam(1e-2)
    # The reference trains each window as one batch with Keras's own step.
    reference = make_model()
    reference.set_weights(model.get_weights())
    optimizer.build(model.trainable_variables)
    accumulator = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)

    def compute_loss_and_updates(trainable, non_trainable, xb, yb):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, xb,
                                                     training=True)
        return loss_fn(yb, logits), non_trainable

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, xb, yb):
        trainable, non_trainable, optimizer_vars, accumulator_vars = state
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, xb, yb)
        # Weight each micro-batch by its size: the update is exact for 16/16/8.
        trainable, optimizer_vars, accumulator_vars = accumulator.stateless_step(
            optimizer, grads, trainable, optimizer_vars, accumulator_vars,
            weight=xb.shape[0],
        )
        return loss, (trainable, non_trainable, optimizer_vars, accumulator_vars)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
        [v.value for v in accumulator.variables],
    )
    bounds = [(s + lo, s + hi) for s in range(0, 400, 40)
              for lo, hi in ((0, 16), (16, 32), (32, 40))]
    bounds += [(400, 416), (416, 420)]  # the data ends inside a window
    for lo, hi in bounds:
        _, state = train_step(state, x[lo:hi], y[lo:hi])
    trainable, non_trainable, optimizer_vars, accumulator_vars = state
    # After the data: the open window (16 + 4 samples) is applied as a smaller batch.
    trainable, optimizer_vars, accumulator_vars = accumulator.stateless_apply(
        optimizer, trainable, optimizer_vars, accumulator_vars
    )
    for variables, values in ((model.trainable_variables, trainable),
                              (model.non_trainable_variables, non_trainable),
                              (optimizer.variables, optimizer_vars),
                              (accumulator.variables, accumulator_vars)):
        for variable, value in zip(variables, values):
            variable.assign(value)

    # The same windows as large batches, with Keras's own training step.
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss_fn)
    for start in list(range(0, 400, 40)) + [400]:
        end = min(start + 40, 420)
        reference.train_on_batch(x[start:end], y[start:end])

    gap = max(
        float(np.abs(a - b).max())
        for a, b in zip(model.get_weights(), reference.get_weights())
    )
    accuracy = float((np.asarray(model(x)).argmax(1) == y).mean())
    print(f"updates: {int(optimizer.iterations.numpy())} (micro-batches: {len(bounds)})")
    print(f"train accuracy: {accuracy:.3f}")
    print(f"max |weight - large-batch weight|: {gap:.2e}")
    return gap


if __name__ == "__main__":
    main()
