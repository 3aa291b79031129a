"""PyTorch: a custom training loop with gradaccum's GradientAccumulator.

For Keras's PyTorch backend (it sets `KERAS_BACKEND` itself). For TensorFlow see
`custom_loop.py`, for JAX `jax_custom_loop.py`.

The loop is keras.io's "Writing a training loop from scratch in PyTorch": the
forward pass, `loss.backward()`, and the parameters' `.grad`. `accumulator.step`
takes the place of `optimizer.apply`: micro-batches of unequal size (16, 16, 8)
make one update per window of 40 samples, equal to one step on the whole window,
and the last window of the data (a partial one) is flushed. It prints the largest
gap between its weights and those of Keras's own step on each window as one large
batch: float rounding.

    python examples/torch_custom_loop.py
"""

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

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
    accumulator = gradaccum.GradientAccumulator(model.trainable_variables, steps=3)

    bounds = [(s + lo, s + hi) for s in range(0, 400, 40)
              for lo, hi in ((0, 16), (16, 32), (32, 40))]
    bounds += [(400, 416), (416, 420)]  # the data ends inside a window
    for lo, hi in bounds:
        xb, yb = torch.as_tensor(x[lo:hi]), torch.as_tensor(y[lo:hi])
        loss = loss_fn(yb, model(xb, training=True))
        model.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in model.trainable_weights]
        # Weight each micro-batch by its size: the update is exact for 16/16/8.
        accumulator.step(optimizer, grads, weight=len(xb))
    # After the data: the open window (16 + 4 samples) is applied as a smaller batch.
    accumulator.apply(optimizer)

    # The same windows as large batches, with Keras's own training step.
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss_fn)
    for start in list(range(0, 400, 40)) + [400]:
        end = min(start + 40, 420)
        reference.train_on_batch(x[start:end], y[start:end])

    gap = max(
        float(np.abs(a - b).max())
        for a, b in zip(model.get_weights(), reference.get_weights())
    )
    logits = keras.ops.convert_to_numpy(model(torch.as_tensor(x)))
    accuracy = float((logits.argmax(1) == y).mean())
    print(f"updates: {int(optimizer.iterations.numpy())} (micro-batches: {len(bounds)})")
    print(f"train accuracy: {accuracy:.3f}")
    print(f"max |weight - large-batch weight|: {gap:.2e}")
    return gap


if __name__ == "__main__":
    main()
