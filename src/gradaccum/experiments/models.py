"""The networks of the seed experiment (logits over 10 digits)."""

from __future__ import annotations

MODELS = ("mlp", "cnn")
OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop")


def build_model(name: str = "mlp", seed: int = 0):
    """`mlp`: 784-128-10 with ReLU; `cnn`: two 3x3 conv blocks and a linear head.

    The initial weights come from `seed` alone (each layer's initializer is seeded),
    the same way on every backend's run, without a global seed.
    """
    import keras

    base = seed % (2**31 - 8)  # (a 32-bit run seed; every layer's seed fits in int32)
    seeds = iter(range(base, base + 8))

    def init():
        return {"kernel_initializer": keras.initializers.GlorotUniform(seed=next(seeds))}

    if name == "mlp":
        layers = [
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu", **init()),
            keras.layers.Dense(10, **init()),
        ]
    elif name == "cnn":
        layers = [
            keras.layers.Reshape((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu", **init()),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu", **init()),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10, **init()),
        ]
    else:
        raise ValueError(f"`model` must be one of {', '.join(MODELS)}. Received: model={name!r}")
    return keras.Sequential([keras.Input((28, 28)), *layers], name=name)


def build_optimizer(name: str = "adam", learning_rate: float = 1e-3):
    """A Keras optimizer by name with the given learning rate."""
    import keras

    classes = {
        "adam": keras.optimizers.Adam,
        "adamw": keras.optimizers.AdamW,
        "sgd": keras.optimizers.SGD,
        "rmsprop": keras.optimizers.RMSprop,
    }
    if name not in classes:
        raise ValueError(
            f"`optimizer` must be one of {', '.join(OPTIMIZERS)}. Received: optimizer={name!r}"
        )
    return classes[name](learning_rate)
