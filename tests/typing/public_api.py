"""The public API as users write it, for the type checker (issue 56): `mypy --strict`
on this file (tests/test_types.py) fails on a public name left without annotations
(`no-untyped-call`) and on an argument or result of the wrong type.

Nothing here runs: the functions are only read by mypy (pytest does not collect this
folder: tests/conftest.py). Keras, TensorFlow and JAX ship no type hints mypy can use,
so their objects are `Any`; gradaccum's own signatures are what is checked.
"""

from __future__ import annotations

import pathlib
from typing import Any

import keras
import numpy as np

import gradaccum
from gradaccum.backends.jax.accumulator import GradientAccumulator as JaxAccumulator
from gradaccum.backends.torch.accumulator import GradientAccumulator as TorchAccumulator


def make_model() -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])


def data() -> tuple[np.ndarray, np.ndarray]:
    return np.ones((64, 4), "float32"), np.zeros((64, 1), "float32")


def accumulate_in_fit() -> float:
    """`accumulate` and `disable` on the model's own `fit`, every kind of option."""
    x, y = data()
    model: keras.Model = gradaccum.accumulate(make_model(), steps=4)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.train_on_batch(x[:8], y[:8])
    held: int = gradaccum.end_of_data(model)
    assert held == 1
    model = gradaccum.disable(model)
    model = gradaccum.accumulate(model, micro_batch_size="auto", max_micro_batch_size=16)
    model = gradaccum.disable(model)
    model = gradaccum.accumulate(
        model,
        [(0, 1), (2, 4)],
        weighting="uniform",
        partial="carry",
        reduction="sum",
        accumulator_dtype="float32",
        nonfinite="raise",
        moving_statistics="micro_batch",
    )
    model = gradaccum.disable(model)

    def ramp(update_index: Any) -> Any:
        return keras.ops.minimum(update_index + 1, 8)

    def by_size(x: Any, y: Any, sample_weight: Any) -> Any:
        return keras.ops.shape(x)[0]

    def skip_all(gradients: Any) -> bool:
        return True

    model = gradaccum.accumulate(model, ramp, weighting=by_size, nonfinite=skip_all)
    model = gradaccum.disable(model)
    model = gradaccum.accumulate(model, weight_per_update=256.0)
    privacy = gradaccum.Privacy(1.0, 1.1, seed=0, dataset_size=64, delta=1e-5)
    private: keras.Model = gradaccum.accumulate(make_model(), steps=4, privacy=privacy)
    epsilon: float = gradaccum.privacy_spent(private)
    return epsilon + gradaccum.privacy_spent(private, dataset_size=128, delta=1e-6)


def numpy_values_and_other_schedules() -> keras.Model:
    """What the checks admit, the hints admit: NumPy integers and floats, schedules
    as lists of lists or an (n, 2) array, a callable."""
    model = gradaccum.accumulate(make_model(), steps=np.int64(4),
                                 weight_per_update=np.float32(64.0))
    model = gradaccum.disable(model)
    model = gradaccum.accumulate(model, steps=[[0, 1], [2, 4]])
    model = gradaccum.disable(model)
    model = gradaccum.accumulate(model, steps=np.array([[0, 1], [2, 4]]))
    model = gradaccum.disable(model)
    model = gradaccum.accumulate(model, steps=lambda update: 2 if update < 3 else 4,
                                 micro_batch_size=np.int32(4),
                                 max_micro_batch_size=np.int64(8))
    gradaccum.Privacy(np.float32(1.0), np.float64(1.1), seed=np.int64(3),
                      dataset_size=np.int64(64), delta=np.float32(1e-5))
    x, y = data()
    gradaccum.audit(make_model(), x, y, steps=np.int64(2), batch_size=np.int64(8))
    return model


def wrap_and_load(path: pathlib.Path) -> keras.Model:
    """`wrap` (and `AccumulatingModel`), `load_model`."""
    x, y = data()
    trainer: gradaccum.AccumulatingModel = gradaccum.wrap(make_model(), steps=2)
    trainer.compile(optimizer="sgd", loss="mse", steps_per_execution=1)
    trainer.fit(x, y, batch_size=4, epochs=2, verbose=0)
    trainer.save_weights(str(path / "trainer.weights.h5"))
    config: dict[str, Any] = trainer.get_config()
    again = gradaccum.AccumulatingModel.from_config(config)
    other = gradaccum.AccumulatingModel(make_model(), steps=2, convert_batch_norm=False)
    inner: keras.Model = again.model if other.model is not None else trainer.model
    model = gradaccum.accumulate(make_model(), steps=4, partial="carry")
    model.save(path / "model.keras")
    loaded: keras.Model = gradaccum.load_model(path / "model.keras")
    loaded = gradaccum.load_model(str(path / "model.keras"), compile=False, safe_mode=True)
    return loaded if inner is not None else model


def audit_a_model() -> bool:
    """`audit` and its `AuditReport`."""
    x, y = data()
    model = make_model()
    model.compile("adam", "mse")
    report: gradaccum.AuditReport = gradaccum.audit(
        model, x, y, steps=4, batch_size=8, weighting="exact", reduction="mean"
    )
    text: str = str(report) + repr(report)
    largest: float = report.max_difference
    causes: list[str] = report.causes + report.rules
    sizes: list[int] = report.micro_batch_sizes
    rows: list[tuple[str, float, float, float]] = report.rows
    return report.exact and bool(text) and largest >= 0 and bool(causes or sizes or rows)


def privacy_options() -> float:
    privacy = gradaccum.Privacy(l2_norm_clip=1.0, noise_multiplier=0.0, seed=None,
                                accountant="pld")
    seed: int = privacy.noise_seed()
    logs: bool = privacy.logs_epsilon
    return privacy.noise_stddev + seed + logs


def tensorflow_loop() -> int:
    """The TensorFlow custom loop's accumulator (`gradaccum.GradientAccumulator` under
    Keras's TensorFlow backend), its batch normalization and its counting ops."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              gradaccum.BatchNormalization(), keras.layers.Dense(1)])
    converted: keras.Model = gradaccum.convert_batch_normalization(make_model())
    optimizer = keras.optimizers.Adam(1e-2)
    acc = gradaccum.GradientAccumulator(
        model.trainable_variables, steps=2, reduction="mean", accumulator_dtype="float32",
        layers=[model, converted], nonfinite="skip", name="acc",
    )
    grads = [keras.ops.zeros_like(v) for v in model.trainable_variables]
    applied = acc.step(optimizer, grads, weight=4)
    accepted = acc.accumulate(grads, 4.0)
    accepted = acc.accumulate_weighted(grads, 4.0, loss_scale_optimizer=None)
    combined: list[Any] = acc.gradients()
    acc.apply(optimizer)
    acc.apply_if(optimizer, applied)
    acc.reset()
    state: dict[str, Any] = acc.state_variables()
    dtype_name: str = acc.reduction
    budget = gradaccum.GradientAccumulator(model.trainable_variables, weight_per_update=10.0)
    ops = gradaccum.CountingCrossDeviceOps()
    ops.reset()
    return (len(combined) + len(state) + len(dtype_name) + int(accepted)
            + int(budget.micro_step) + int(ops.reductions))


def jax_loop() -> tuple[list[Any], list[Any], list[Any]]:
    """The JAX custom loop's accumulator (`gradaccum.GradientAccumulator` under Keras's
    JAX backend)."""
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    acc = JaxAccumulator(model.trainable_variables, steps=2, nonfinite="raise")
    trainable = [v.value for v in model.trainable_variables]
    optimizer_vars = [v.value for v in optimizer.variables]
    acc_vars = [v.value for v in acc.variables]
    grads = [keras.ops.zeros_like(v) for v in trainable]
    trainable, optimizer_vars, acc_vars = acc.stateless_step(
        optimizer, grads, trainable, optimizer_vars, acc_vars, weight=4)
    acc_vars = acc.stateless_accumulate(grads, acc_vars, weight=4)
    acc.check(acc_vars)
    acc_vars = acc.clear(acc_vars)
    return acc.stateless_apply(optimizer, trainable, optimizer_vars, acc_vars)


def torch_loop() -> dict[str, Any]:
    """The PyTorch custom loop's accumulator (`gradaccum.GradientAccumulator` under
    Keras's PyTorch backend)."""
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    acc = TorchAccumulator(model.trainable_variables, steps=[(0, 1), (2, 2)],
                           process_group=None)
    grads = [v.value.grad for v in model.trainable_weights]
    with acc.no_sync(model):
        applied = acc.step(optimizer, grads, weight=4)
    acc.accumulate(grads, weight=float(applied.item()))
    acc.apply(optimizer)
    acc.drop()
    saved: dict[str, Any] = acc.state_dict()
    acc.load_state_dict(saved)
    reductions: int = acc.all_reduces
    return {"reductions": reductions, **saved}


version: str = gradaccum.__version__
