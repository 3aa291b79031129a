"""`wrap(model, steps=k)`: train a Keras model inside an `AccumulatingModel`.

`AccumulatingModel` is a `keras.Model` around the user's model: it calls it, and
`fit` trains the wrapped model's own variables with gradaccum's exact step and the
wrapper's compiled loss. The accumulation itself is the one mechanism of
`gradaccum.accumulate` (the backend's `Accumulation`) attached to the wrapper. Prefer
`gradaccum.accumulate`, which trains the model through its own `fit`, `train_step`
and `compute_loss`; `wrap` stays for code written against it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import keras

from gradaccum import _backend, state_file
from gradaccum import _keras_common as kc
from gradaccum.adapter import ATTRIBUTE, Accumulation
from gradaccum.core.hints import Steps
from gradaccum.core.options import (
    NAMES,
    AccumulationOptions,
    Options,
    Unpack,
    given,
    takes_options,
)
from gradaccum.core.privacy import check_model as check_private_model
from gradaccum.core.validation import check_optimizer
from gradaccum.core.window import PARTIALS  # noqa: F401 (re-exported)
from gradaccum.weighting import record_normalizers


class ModelOptions(AccumulationOptions, total=False):
    """What `AccumulatingModel` takes by keyword after `steps` and
    `convert_batch_norm`: the options, and Keras's `Model` arguments."""

    name: str | None
    trainable: bool
    dtype: Any
    autocast: bool
    activity_regularizer: Any


@keras.saving.register_keras_serializable(package="gradaccum")
class AccumulatingModel(keras.Model):
    """A `keras.Model` that trains `model` with exact gradient accumulation.

    Created by `gradaccum.wrap`; see there for the arguments. `trainer.model` is the
    wrapped model: it holds the trained weights, and `trainer.model.save()` writes a
    plain Keras model (one that needs gradaccum to load if it holds
    `gradaccum.BatchNormalization` layers).

    Raises:
        ValueError: as `gradaccum.wrap`.

    Examples:

        >>> import keras, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> trainer = gradaccum.AccumulatingModel(model, steps=2, partial="drop")
        >>> trainer.compile(optimizer="sgd", loss="mse")
        >>> history = trainer.fit(np.ones((10, 2)), np.ones((10, 1)), batch_size=2, verbose=0)
        >>> int(trainer.optimizer.iterations)  # 5 micro-batches: 2 windows, 1 dropped
        2
        >>> trainer.model is model
        True
    """

    @takes_options
    def __init__(
        self,
        model: keras.Model,
        *,
        steps: Steps | None = None,
        convert_batch_norm: bool = False,
        **kwargs: Unpack[ModelOptions],
    ) -> None:
        if not isinstance(model, keras.Model):
            raise ValueError(
                "`model` must be a keras.Model. "
                f"Received: model={model!r} of type {type(model).__name__}"
            )
        if isinstance(model, AccumulatingModel):
            raise ValueError(
                "`model` must be a keras.Model that is not already wrapped. "
                f"Received: model={model.name!r}, a gradaccum AccumulatingModel; "
                "wrap its `.model` instead."
            )
        if not isinstance(convert_batch_norm, bool):
            raise ValueError(
                "`convert_batch_norm` must be True or False. "
                f"Received: convert_batch_norm={convert_batch_norm!r}"
            )
        adapter = _backend.adapter()
        if convert_batch_norm:
            if keras.backend.backend() != "tensorflow":
                raise ValueError(
                    "`convert_batch_norm` must be False on Keras's "
                    f"{keras.backend.backend()!r} backend: gradaccum.BatchNormalization "
                    "runs on TensorFlow. Received: convert_batch_norm=True"
                )
            from gradaccum.backends.tensorflow.batch_norm import convert_batch_normalization

            model = convert_batch_normalization(model)
        if model.built:
            adapter.check_model(model)
        rest: dict[str, Any] = dict(kwargs)
        options = adapter.checked_options(
            steps=steps, **{name: rest.pop(name) for name in NAMES if name in rest})
        if options.privacy is not None:
            # The wrapper's own step and compiled loss train `model`.
            check_private_model(model, own_train_step=False,
                                layers=kc.flatten_layers(model))
        _warn_if_own_training(model)
        rest.setdefault("name", f"gradaccum_{model.name}")
        super().__init__(**rest)
        self.model = model
        # The options as attributes (`micro_batch_size` is the size in use, below).
        for name in NAMES:
            if name != "micro_batch_size":
                setattr(self, name, getattr(options, name))
        # The accumulation (the backend's adapter), outside Keras's tracking.
        self.__dict__[ATTRIBUTE] = adapter(options, layers=model)
        self._accumulation.attach(self)
        # The micro-batch size in use (split mode), outside Keras's tracking.
        self.__dict__["micro_batch_size"] = self._accumulation.micro_batch_size
        if model.built:
            self.built = True

    @property
    def _accumulation(self) -> Accumulation:
        """The accumulation that trains the wrapped model (`gradaccum.adapter`)."""
        return self.__dict__[ATTRIBUTE]

    @property
    def _fit_state(self) -> Any:
        """The accumulation state of fit (None before the first training step)."""
        return self._accumulation.state

    # Keras model protocol --------------------------------------------------------

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.model(inputs, training=training)

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, *args: Any,
                steps_per_execution: int | str = "window", **kwargs: Any) -> None:
        """Configures training as `keras.Model.compile`, with one difference.

        `steps_per_execution` defaults to `"window"`: one compiled call runs the
        `steps` micro-batches of a window (batch-level callbacks then see windows, as
        with any `steps_per_execution`; 1 when windows vary: a schedule or a weight
        budget). Pass an integer (1 for per-micro-batch
        callbacks) to choose. Under a tf.distribute strategy with several replicas
        `"window"` means 1: Keras's multi-step train function fails there (keras
        issue 19246, "You must feed a value for placeholder tensor").
        """
        self._accumulation.chose_steps_per_execution = steps_per_execution == "window"
        if steps_per_execution == "window":
            steps_per_execution = self._accumulation.default_steps_per_execution()
        optimizer = keras.optimizers.get(optimizer)
        check_optimizer(optimizer)
        if self.weighting == "exact" and self.privacy is None:
            loss = record_normalizers(loss, self._accumulation.normalizers,
                                      self._accumulation.options.reduction)
        super().compile(optimizer, loss, *args, steps_per_execution=steps_per_execution,
                        **kwargs)
        self._accumulation.forget()

    def compile_from_config(self, config: dict) -> None:
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def get_config(self) -> dict[str, Any]:
        return {
            "model": keras.saving.serialize_keras_object(self.model),
            **self._accumulation.options.config(),
            # The saved model holds the converted layers already.
            "convert_batch_norm": False,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any],
                    custom_objects: dict[str, Any] | None = None) -> AccumulatingModel:
        config = dict(config)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        options = Options.from_config(config, custom_objects)
        rest = {k: v for k, v in config.items() if k not in options}
        return cls(model, **options, **rest)

    def make_train_function(self, force: bool = False) -> Any:
        return self._accumulation.make_train_function(
            lambda force: super(AccumulatingModel, self).make_train_function(force=force),
            force,
        )

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None,
            epochs: int = 1, verbose: Any = "auto", callbacks: Any = None,
            **kwargs: Any) -> Any:
        return self._accumulation.fit(
            super().fit, x, y, batch_size, epochs, verbose, callbacks, kwargs
        )

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        self._accumulation.before_evaluate(kwargs)
        with self._accumulation.evaluating():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        self._accumulation.before_predict(args, kwargs)
        return super().predict(*args, **kwargs)

    def train_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        return self._accumulation.train_on_batch(super().train_on_batch, args, kwargs)

    def train_step(self, *args: Any) -> Any:
        # (data) on TensorFlow, (state, data) on JAX.
        return self._accumulation.train_step(*args)

    # Saving: the accumulation state travels with the weights ---------------------

    def save_weights(self, filepath: Any, overwrite: bool = True, *args: Any,
                     **kwargs: Any) -> None:
        """Keras's `save_weights`, the window state inside the weights file,
        written to a temporary file renamed over `filepath`: a kill during the save
        leaves the previous file whole (`gradaccum.state_file`)."""
        filepath = os.fspath(filepath)
        proceed, sharded = state_file.keras_save(filepath, overwrite, args, kwargs)
        if not proceed:
            return
        state_file.save_atomically(
            lambda path: super(AccumulatingModel, self).save_weights(
                path, True, *args, **kwargs),
            filepath, atomic=not sharded)

    def save_own_variables(self, store: Any) -> None:
        super().save_own_variables(store)
        self._accumulation.save_to(store)

    def load_own_variables(self, store: Any) -> None:
        self._accumulation.load_from(store)
        super().load_own_variables(
            {k: store[k] for k in store.keys() if not k.startswith("gradaccum_")}
        )


def _warn_if_own_training(model: keras.Model) -> None:
    """wrap trains with the wrapper's step and compiled loss: a model whose class
    defines its own would silently get another objective."""
    own = [
        name
        for name in ("fit", "train_step", "compute_loss")
        if getattr(type(model), name) is not getattr(keras.Model, name)
    ]
    if own:
        warnings.warn(
            f"gradaccum.wrap trains {type(model).__name__} with the wrapper's own step "
            f"and compiled loss, so its own {', '.join(f'`{n}`' for n in own)} will not "
            "run. Use `gradaccum.accumulate(model, steps=...)`, which trains the model "
            "through its own fit, train_step and compute_loss.",
            stacklevel=3,
        )


@takes_options
def wrap(
    model: keras.Model,
    steps: Steps | None = None,
    *,
    convert_batch_norm: bool = False,
    **options: Unpack[AccumulationOptions],
) -> AccumulatingModel:
    """Wraps a Keras model so that `fit()` trains it with gradient accumulation.

    Each batch of `fit` is a micro-batch; every `steps` micro-batches the optimizer
    makes one update with their combined gradient. The update equals one step on
    the concatenated window (with `weighting="exact"`), and the optimizer's
    iterations, learning-rate schedule, clipping, weight decay and EMA count updates.

    Args:
        model: the `keras.Model` to train. The returned model shares its variables:
            after `fit`, `model` holds the trained weights.
        {options}
        convert_batch_norm: if True, train a copy of `model` whose Keras
            `BatchNormalization` layers are `gradaccum.BatchNormalization` (gamma,
            beta and moving statistics carried over; see
            `gradaccum.convert_batch_normalization`): moving statistics then move
            once per update from the window's statistics. `trainer.model` is that
            copy, and `model` is left untouched. Without it, layers that already are
            `gradaccum.BatchNormalization` are driven by the accumulator anyway.

    Mixed precision: under the `mixed_float16` policy Keras wraps the optimizer in a
    `LossScaleOptimizer`; a micro-batch whose gradient is not finite is then skipped
    with its weight, the loss scale backs off, and the logs show `skipped`.

    Returns:
        An `AccumulatingModel` to `compile` and `fit` like any Keras model. Its logs
        include `updates`, the optimizer's update count, and what the last update's
        window held: `window_micro_batches` and `window_weight`.

    Raises:
        ValueError: if `model` is not a Keras model, or on an invalid `steps` or
            `weight_per_update` (or both given),
            `weighting`, `partial`, `reduction`, `accumulator_dtype`,
            `convert_batch_norm` or `nonfinite`, or (with `convert_batch_norm`) a subclassed model
            or a BatchNormalization option that cannot be honoured.

    Examples:

        >>> import keras, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> trainer = gradaccum.wrap(model, steps=4)
        >>> trainer.compile(optimizer="adam", loss="mse")
        >>> x, y = np.ones((100, 4)), np.zeros((100, 1))
        >>> history = trainer.fit(x, y, batch_size=8, epochs=2, verbose=0)
        >>> history.history["updates"]  # 13 micro-batches per epoch: 3 windows + 1 partial
        [4.0, 8.0]
        >>> int(trainer.optimizer.iterations)
        8
    """
    return AccumulatingModel(model, steps=steps, convert_batch_norm=convert_batch_norm,
                             **given(options, "wrap"))
