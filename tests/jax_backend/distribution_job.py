"""gradaccum under keras.distribution on N virtual CPU devices, for
tests/jax_backend/test_jax_distribution.py (JAX fixes its devices per process).

    KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=N \
        python tests/jax_backend/distribution_job.py

Each case trains a model with `accumulate` under a distribution (`DataParallel` over
the N devices, or `ModelParallel` on an (N/2, 2) mesh whose LayoutMap shards kernels
and embeddings on the "model" axis), and the same model with the same options on one
device; it reports the largest gap between their weights and optimizer variables,
each accumulator's sharding beside its variable's, the fit's warnings and the
collectives of the compiled train step (`benchmarks/hlo.py`). `VARIANTS` are models
and options (regularizers, dropout, weighting) trained under DataParallel. The last
line printed is the JSON of the results.
"""

from __future__ import annotations

import json
import pathlib
import sys
import warnings

import jax
import keras
import numpy as np

import gradaccum
from gradaccum.attach import accumulation_of

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
from hlo import train_step_collectives  # noqa: E402

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp(seed=0, name=None):
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh", name="dense_a"),
        keras.layers.Dense(4, name="dense_b"),
    ], name=name)
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def tokens(seed=0):
    """Masked token sequences: an embedding (sharded on its features), a per-token
    loss over the unmasked positions."""
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(16, 8, mask_zero=True, name="embedding")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="dense_a")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="dense_b")(h))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


MODELS = {"mlp": mlp, "tokens": tokens}


def data(model_name, n=48):
    rng = np.random.default_rng(1)
    if model_name == "mlp":
        return (rng.normal(size=(n, 6)).astype("float32"),
                rng.integers(0, 4, size=(n,)).astype("int32"))
    lengths = rng.integers(1, 6, size=n)
    x = np.zeros((n, 5), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.integers(1, 16, size=length)
    return x, rng.integers(0, 4, size=(n, 5)).astype("int32")


def distribution(kind):
    devices = jax.devices()
    if kind == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh((len(devices) // 2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    layout_map[".*dense.*bias"] = ("model",)
    layout_map[".*embedding.*embeddings"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def train(model_name, options, kind=None):
    keras.distribution.set_distribution(None if kind is None else distribution(kind))
    try:
        model = gradaccum.accumulate(MODELS[model_name](), **options)
        model.compile(keras.optimizers.Adam(0.01), SCE)
        x, y = data(model_name)
        # Split mode: batches of 12 as micro-batches of 8 and a shorter last one,
        # each taking an equal part of every data shard.
        batch = 12 if options.get("micro_batch_size") == 8 else 8
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                                verbose=0)
        SEEN[id(model)] = {
            "warnings": [str(w.message) for w in caught if "gradaccum" in str(w.message)],
            "collectives": (None if kind is None or options.get("micro_batch_size") == "auto"
                            else step_collectives(model, x, y, batch)),
        }
        state = accumulation_of(model).state
        shardings = {
            v.path: {
                "shape": list(v.shape),
                "variable": str(getattr(v.value.sharding, "spec", None)),
                "accumulator": str(getattr(acc.value.sharding, "spec", None)),
                "variable_shard": list(v.value.sharding.shard_shape(v.shape)),
                "accumulator_shard": list(acc.value.sharding.shard_shape(acc.shape)),
                "accumulator_shape": list(acc.shape),
                "devices": len(acc.value.sharding.device_set),
            }
            for v, acc in zip(model.trainable_variables, state.accumulators)
        }
        return model, history, shardings
    finally:
        keras.distribution.set_distribution(None)


def step_collectives(model, x, y, batch) -> list:
    """`(kind, bytes, place)` of each collective of the compiled train step on a
    batch (`benchmarks/hlo.py`: place "call", "loop" or "update")."""
    return [(c.kind, c.bytes, c.place)
            for c in train_step_collectives(model, (x[:batch], y[:batch]))]


def gap(a, b):
    weights = max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))
    optimizer = max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(a.optimizer.variables, b.optimizer.variables)
    )
    return max(weights, optimizer)


def misfit_layout() -> str:
    """A model built on one device, then trained under a LayoutMap that shards a
    4-wide kernel dimension over 3 devices: the accumulator cannot take it."""
    model = gradaccum.accumulate(mlp(name="built_on_one_device"), steps=2)
    model.compile(keras.optimizers.Adam(0.01), SCE)
    devices = jax.devices()[:3]
    mesh = keras.distribution.DeviceMesh((1, 3), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_b.*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map,
                                                    batch_dim_name="batch")
    return refusal(distribution, lambda: model)


def indivisible_micro_batch() -> str:
    """Split mode with micro-batches of 3 over batches sharded on all devices."""
    def make():
        model = gradaccum.accumulate(mlp(), micro_batch_size=3)
        model.compile(keras.optimizers.Adam(0.01), SCE)
        return model

    return refusal(keras.distribution.DataParallel(devices=jax.devices()), make)


def refusal(distribution, make) -> str:
    """The ValueError's message when the model `make()` gives (made under
    `distribution`) fits a batch of 8 under it ("no error" if none)."""
    keras.distribution.set_distribution(distribution)
    try:
        x, y = data("mlp")
        make().fit(x, y, batch_size=8, epochs=1, verbose=0)
    except ValueError as error:
        return str(error)
    finally:
        keras.distribution.set_distribution(None)
    return "no error"


batch_norm_warnings: list = []
# What each trained model's fit warned and its train step's collectives, by id.
SEEN: dict = {}


def batch_norm_gap() -> float:
    """Keras's BatchNormalization under DataParallel, steps=3 on batches of 8: the
    largest gap of its moving statistics from plain Keras on one device trained on the
    windows (the global windows of 24) as whole batches."""

    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        h = keras.layers.Dense(6, trainable=False)(inputs)
        h = keras.layers.BatchNormalization(momentum=0.9, name="bn")(h)
        return keras.Model(inputs, keras.layers.Dense(3)(h))

    rng = np.random.default_rng(0)
    x = (rng.normal(size=(48, 5)) * 3 + 1).astype("float32")
    y = rng.integers(0, 3, 48)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = make()
    reference.compile(keras.optimizers.SGD(0.01), loss)
    for window in (np.r_[0:24], np.r_[24:48]):
        reference.train_on_batch(x[window], y[window])
    with keras.distribution.DataParallel().scope(), warnings.catch_warnings(
            record=True) as caught:
        warnings.simplefilter("always")
        model = gradaccum.accumulate(make(), steps=3)
        model.compile(keras.optimizers.SGD(0.01), loss)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    batch_norm_warnings[:] = [str(w.message) for w in caught
                              if "gradaccum" in str(w.message)]
    ours, theirs = model.get_layer("bn"), reference.get_layer("bn")
    return float(max(np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in (
        (ours.moving_mean, theirs.moving_mean),
        (ours.moving_variance, theirs.moving_variance))))


def regularized(seed=0):
    """The MLP with an L2 kernel regularizer: a loss term every device adds alike."""
    model = mlp(seed)
    model.layers[0].kernel_regularizer = keras.regularizers.L2(0.05)
    return model


def active(seed=0):
    """The MLP with an activity regularizer: a loss term from the samples."""
    model = mlp(seed)
    model.layers[0].activity_regularizer = keras.regularizers.L2(0.05)
    return model


def dropped(seed=0):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="dense_a")(inputs)
    h = keras.layers.Dropout(0.3, seed=5)(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="dense_b")(h))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


class OwnLoss(keras.Model):
    """A model with its own `compute_loss` (the compiled loss and a term of its
    own)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.1 * keras.ops.mean(y_pred ** 2)


def own_loss(seed=0):
    inner = mlp(seed)
    return OwnLoss(inner.inputs, inner.outputs)


VARIANTS = {
    # name: (model, options); each trained on one device and under DataParallel.
    "regularized": (regularized, {"steps": 3}),
    "activity": (active, {"steps": 3}),
    "activity_sharded": (active, {"steps": 3, "sums": "sharded"}),
    "own_compute_loss": (own_loss, {"steps": 3}),
    "uniform": (mlp, {"steps": 3, "weighting": "uniform"}),
    "reduction_sum": (mlp, {"steps": 3, "reduction": "sum"}),
    "dropout": (dropped, {"steps": 3}),
    "dropout_reduced": (dropped, {"steps": 3, "sums": "reduced"}),
}


def variant(make, options, distributed):
    keras.distribution.set_distribution(
        keras.distribution.DataParallel() if distributed else None)
    try:
        keras.utils.set_random_seed(0)
        model = gradaccum.accumulate(make(), **options)
        model.compile(keras.optimizers.Adam(0.01), SCE)
        x, y = data("mlp")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        said = [str(w.message) for w in caught if "gradaccum" in str(w.message)]
        seeds = [np.asarray(v).tolist() for v in model.non_trainable_variables]
        return model, history, said, seeds
    finally:
        keras.distribution.set_distribution(None)


def variants() -> dict:
    """Each variant's gap from one device, its warnings and its seed states."""
    found = {}
    for name, (make, options) in VARIANTS.items():
        reference, expected, _, seeds = variant(make, options, False)
        model, history, said, distributed_seeds = variant(make, options, True)
        found[name] = {
            "gap": gap(model, reference),
            "loss_gap": float(np.max(np.abs(np.asarray(history.history["loss"])
                                            - expected.history["loss"]))),
            "warnings": said,
            "seeds_equal": seeds == distributed_seeds,
        }
    return found


def hub_gap() -> dict:
    """A tiny KerasHub `GPT2CausalLM` fine-tuned on strings (its preprocessor in
    tf.data, padded sequences: each device's share holds its own number of tokens),
    `steps=3` on batches of 4 under DataParallel on the 4 devices, against one
    device; with each device's own sums and with sharded ones."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
    import hub_models

    found = {}
    texts = hub_models.make_texts()
    for sums in ("local", "sharded"):
        trained = []
        for distributed in (False, True):
            keras.distribution.set_distribution(
                keras.distribution.DataParallel() if distributed else None)
            try:
                task = hub_models.make_task(seed=0)
                gradaccum.accumulate(task, steps=3, sums=sums)
                hub_models.compile_task(task)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    task.fit(texts, batch_size=4, shuffle=False, verbose=0)
                said = [str(w.message) for w in caught if "gradaccum" in str(w.message)]
                trained.append((task, said))
            finally:
                keras.distribution.set_distribution(None)
        (reference, _), (task, said) = trained
        found[sums] = {"gap": gap(task, reference), "warnings": said,
                       "updates": int(task.optimizer.iterations.numpy())}
    return found


def noise_scales() -> dict:
    """The noise scale of a linear model at fixed weights (its truth known: see
    tests/contract/test_noise_scale.py), 128 windows of 4 micro-batches of 16, on one
    device and under DataParallel with each `sums`; and at steps=1 and in split mode,
    where each device's share is a piece."""
    dim, rng = 10, np.random.default_rng(0)
    w_star = rng.normal(size=(dim, 1)).astype("float32")
    r = rng.normal(size=(dim, 1))
    r = (r / np.linalg.norm(r)).astype("float32")
    x = rng.normal(size=(4 * 16 * 128, dim)).astype("float32")
    y = (x @ w_star + rng.normal(size=(len(x), 1))).astype("float32")

    def estimate(options, distributed, batch_size=16):
        keras.distribution.set_distribution(
            distribution("data_parallel") if distributed else None)
        try:
            model = keras.Sequential([keras.Input((dim,)),
                                      keras.layers.Dense(1, use_bias=False)])
            model.layers[0].kernel.assign(w_star + r)
            gradaccum.accumulate(model, noise_scale=True, **options)
            model.compile(keras.optimizers.SGD(0.0), "mse")
            history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                                verbose=0)
        finally:
            keras.distribution.set_distribution(None)
        return history.history["noise_scale"][0]

    return {
        "truth": dim * 2.0 + 1.0,  # (d (|r|^2 + 1) + |r|^2) / |r|^2 at |r| = 1
        "one_device": estimate({"steps": 4}, False),
        **{sums: estimate({"steps": 4, "sums": sums}, True)
           for sums in ("local", "sharded", "reduced")},
        "steps_1": estimate({"steps": 1}, True, batch_size=64),
        "split": estimate({"micro_batch_size": 16}, True, batch_size=64),
    }


def sharded_refusal() -> str:
    """sums="sharded" for a model whose sums cannot be kept per device."""
    def make():
        inputs = keras.Input((6,))
        h = keras.layers.BatchNormalization(name="bn")(inputs)
        model = gradaccum.accumulate(keras.Model(inputs, keras.layers.Dense(4)(h)),
                                     steps=3, sums="sharded")
        model.compile(keras.optimizers.Adam(0.01), SCE)
        return model

    return refusal(keras.distribution.DataParallel(devices=jax.devices()), make)


def main():
    results = {"devices": len(jax.devices()), "cases": []}
    results["batch_norm"] = batch_norm_gap()
    results["batch_norm_warnings"] = batch_norm_warnings
    for model_name in MODELS:
        for options in ({"steps": 3}, {"micro_batch_size": 8},
                        {"steps": 3, "sums": "sharded"},
                        {"micro_batch_size": 8, "sums": "sharded"}):
            reference, expected, _ = train(model_name, options)
            for kind in ("data_parallel", "model_parallel"):
                model, history, shardings = train(model_name, options, kind)
                results["cases"].append({
                    "model": model_name, "options": options, "kind": kind,
                    "gap": gap(model, reference),
                    # How far training moved the weights (the gap is measured
                    # against this).
                    "moved": float(max(
                        np.max(np.abs(u - v)) for u, v in
                        zip(model.get_weights(), MODELS[model_name]().get_weights())
                    )),
                    "loss_gap": float(np.max(np.abs(
                        np.asarray(history.history["loss"]) - expected.history["loss"]
                    ))),
                    "updates": history.history["updates"],
                    **SEEN[id(model)],
                    "gradient_bytes": sum(int(np.prod(v.shape)) * 4
                                          for v in model.trainable_variables),
                    "shardings": shardings,
                })
    # micro_batch_size="auto" under DataParallel: sizes are multiples of the shards.
    reference, _, _ = train("mlp", {"micro_batch_size": "auto", "max_micro_batch_size": 8})
    model, _, _ = train("mlp", {"micro_batch_size": "auto", "max_micro_batch_size": 8},
                        "data_parallel")
    results["auto"] = {"gap": gap(model, reference), "size": model.micro_batch_size}
    if len(jax.devices()) >= 3:
        results["misfit"] = misfit_layout()
        results["indivisible"] = indivisible_micro_batch()
        results["variants"] = variants()
        results["sharded_refusal"] = sharded_refusal()
        results["hub"] = hub_gap()
        results["noise_scale"] = noise_scales()
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
