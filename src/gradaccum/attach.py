"""`gradaccum.accumulate(model, steps=k)`: accumulation inside the model's own fit.

The model stays the user's object, of its own class: its `fit` (a KerasHub task's
preprocessing included), `compile` defaults, `train_step`, `compute_loss` and `call`
all run. gradaccum adds instance attributes that route the training path through
the backend's `Accumulation` (`backends.tensorflow.fit` or `backends.jax.fit`) and
removes them again in `disable`; the class and its config are untouched, and
`model.save()` writes Keras's file with one more archive member (the open window,
`gradaccum.model_file`), so a saved model loads without gradaccum.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import keras

from gradaccum import _backend, model_file, state_file
from gradaccum import _keras_common as kc
from gradaccum.adapter import ATTRIBUTE, Accumulation, accumulation_of
from gradaccum.core.hints import Steps
from gradaccum.core.options import AccumulationOptions, Unpack, given, takes_options
from gradaccum.core.privacy import check_model as check_private_model
from gradaccum.core.validation import check_optimizer
from gradaccum.weighting import record_normalizers

# The instance attributes gradaccum sets on an accumulating model.
_OVERRIDES = (
    "compile",
    "fit",
    "evaluate",
    "predict",
    "train_step",
    "make_train_function",
    "train_on_batch",
    "save_weights",
    "load_weights",
    "save",
    "save_own_variables",
)
# Split mode: the micro-batch size in use (the one given, or the one "auto" chose).
_SIZE = "micro_batch_size"


@takes_options
def accumulate(
    model: keras.Model,
    steps: Steps | None = None,
    **options: Unpack[AccumulationOptions],
) -> keras.Model:
    """Makes `model`'s own `fit` train with exact gradient accumulation.

    Each batch that `fit` passes to the model's training step becomes one
    micro-batch. After every `steps` micro-batches (a window), each optimizer makes
    one update with their combined gradient, which equals one step on the whole
    window taken as one batch. Everything the model's class defines runs
    unchanged: its `fit` (where a KerasHub task applies its preprocessor),
    `compile` and its defaults, `train_step`, `compute_loss` and `call`.

    - A model that uses Keras's default `train_step` trains with gradaccum's exact
      step: the model's own loss (`compute_loss`, the compiled loss,
      regularizers), weighted by the micro-batch's loss normalizer.
    - A model whose class defines its own `train_step` runs it. gradaccum
      accumulates what the step passes to an optimizer (`apply_gradients` or
      `apply`), for each optimizer of the model separately (a GAN's two), and
      applies each once per window. A micro-batch weighs the normalizer of the
      compiled loss when the step computed it, else its number of samples;
      `weighting="uniform"` or a callable overrides both.

    The optimizer's `iterations`, learning-rate schedules, clipping, weight decay
    and EMA count updates, not micro-batches. `fit`'s logs gain `updates` (the
    optimizer's update count), `window_micro_batches` and `window_weight` (what the
    last update was made of) and `skipped` (micro-batches dropped for a
    non-finite gradient).

    `compile` sets `steps_per_execution` to the window's length by default (1
    under several replicas, with a schedule or with a weight budget); pass it to
    choose. A model compiled before `accumulate` keeps its own.

    Saving: `model.save()` writes the model as Keras would, with the open window
    inside the `.keras` file (plain Keras loads it and ignores the window;
    `gradaccum.load_model` brings it back). `save_weights`, and so
    `keras.callbacks.BackupAndRestore`, writes the open window beside the weights
    file (`<file>.gradaccum.npz`), so a run resumed in the middle of a window goes
    on exactly.

    Split mode (`micro_batch_size` instead of `steps`): `fit`'s batch is the
    window. Every batch the training step receives is cut into micro-batches of at
    most `micro_batch_size` samples, run one at a time, and makes one update equal
    to plain `fit`'s on that batch; epochs, callbacks and schedules count updates.
    With `"auto"` the whole batch is tried first; a step that runs out of memory is
    rolled back and run again with smaller micro-batches (the size in use is
    `model.micro_batch_size`, and is in the logs).

    Args:
        model: a `keras.Model`, compiled or not; it is returned.
        {options}

    Returns:
        `model` itself.

    Raises:
        ValueError: if `model` is not a Keras model or accumulates already, on an
            invalid option, or (at compile) an optimizer that accumulates itself.

    Examples:

        >>> import keras, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model = gradaccum.accumulate(model, steps=4)
        >>> model.compile(optimizer="adam", loss="mse")
        >>> x, y = np.ones((100, 4)), np.zeros((100, 1))
        >>> history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        >>> history.history["updates"]  # 13 micro-batches per epoch: 3 windows + 1 partial
        [4.0, 8.0]
        >>> model = gradaccum.disable(model)  # plain Keras training again
        >>> model = gradaccum.accumulate(model, micro_batch_size=3)  # split mode
        >>> history = model.fit(x, y, batch_size=10, epochs=1, verbose=0)
        >>> history.history["updates"]  # 10 batches of 10, each as 3 + 3 + 3 + 1
        [18.0]
    """
    from gradaccum.keras_model import AccumulatingModel

    given(options, "accumulate")
    if not isinstance(model, keras.Model):
        raise ValueError(
            "`model` must be a keras.Model. "
            f"Received: model={model!r} of type {type(model).__name__}"
        )
    if accumulation_of(model) is not None or isinstance(model, AccumulatingModel):
        raise ValueError(
            "`model` must be a keras.Model that gradaccum does not accumulate for "
            f"already. Received: model={model.name!r}, which accumulates already. Call "
            "`gradaccum.disable(model)` first to change its options."
        )
    adapter = _backend.adapter()
    checked = adapter.checked_options(steps=steps, **options)
    if checked.privacy is not None:
        check_private_model(model, not kc.uses_default_train_step(model),
                            kc.flatten_layers(model))
    if model.built:
        adapter.check_model(model)
    accumulation = adapter(checked, layers=model)
    own_step = None if kc.uses_default_train_step(model) else model.train_step
    accumulation.attach(model, own_step)
    _install(model, accumulation)
    if kc.compile_config(model) is not None:
        _recompile(model, accumulation, user_config=kc.compile_config(model),
                   steps_per_execution_given=True)
    # A model gradaccum.load_model read from a `.keras` file: its saved window.
    model_file.take(model, accumulation, _signature(model, accumulation))
    return model


def disable(model: keras.Model) -> keras.Model:
    """Turns off what `gradaccum.accumulate` turned on: `model` trains as Keras does.

    An open window is closed first as `partial` says (`"flush"` applies it,
    `"drop"` discards it; with `"carry"` a non-empty window is discarded with a
    warning). The model's compile is restored as the user made it.

    Args:
        model: a model returned by `gradaccum.accumulate`.

    Returns:
        `model` itself.

    Raises:
        ValueError: if gradaccum does not accumulate for `model`.

    Examples:

        >>> import keras, gradaccum
        >>> model = gradaccum.accumulate(keras.Sequential([keras.layers.Dense(1)]), steps=2)
        >>> gradaccum.disable(model) is model
        True
    """
    accumulation = accumulation_of(model) if isinstance(model, keras.Model) else None
    if accumulation is None:
        raise ValueError(_not_accumulating(model))
    state = accumulation.state
    if state is not None:
        if accumulation.options.partial == "carry":
            pending = accumulation.open_micro_batches()
            if pending:
                warnings.warn(
                    f"gradaccum.disable discards an open window of {pending} "
                    "micro-batch(es) (partial='carry' keeps windows open across fits).",
                    stacklevel=2,
                )
        else:
            accumulation.end_of_data()
    user_config = accumulation.user_compile_config
    accumulation.release()
    for name in (*_OVERRIDES, ATTRIBUTE, _SIZE):
        model.__dict__.pop(name, None)
    if user_config is not None:
        config = dict(user_config, optimizer=model.optimizer)
        keras.Model.compile(model, **config)
        kc.set_compile_config(model, user_config)
    model.train_function = None
    return model


def end_of_data(model: keras.Model) -> int:
    """Tells `model` its data ended: the open window is closed as `partial` says,
    as `fit` closes it at the end of each epoch.

    `fit` knows where its data ends; a loop of `train_on_batch` calls does not
    (each call is one micro-batch, and a window applies when `steps` calls are
    in). Call this where such a loop's epoch ends: with `partial="flush"` the
    micro-batches of an unfinished window make one update, normalized by their
    own weights, as a smaller last batch would; `"drop"` discards them;
    `"carry"` keeps them for the next window. The next `fit` does the same to a
    window `train_on_batch` left open, before its first batch.

    Args:
        model: a model returned by `gradaccum.accumulate` or `gradaccum.wrap`.

    Returns:
        The micro-batches the open window held (0 if none was open).

    Raises:
        ValueError: if gradaccum does not accumulate for `model`.

    Examples:

        >>> import keras, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model = gradaccum.accumulate(model, steps=4)
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((8, 4)), np.zeros((8, 1))
        >>> for _ in range(6):  # 6 micro-batches: a window of 4, and 2 open
        ...     logs = model.train_on_batch(x, y)
        >>> int(model.optimizer.iterations)
        1
        >>> gradaccum.end_of_data(model)  # the 2 make the epoch's last update
        2
        >>> int(model.optimizer.iterations)
        2
    """
    accumulation = accumulation_of(model) if isinstance(model, keras.Model) else None
    if accumulation is None:
        raise ValueError(_not_accumulating(model))
    held = accumulation.open_micro_batches()
    accumulation.close_outside_fit(always=True)
    return held


def _not_accumulating(model: Any) -> str:
    received = (
        f"model={model.name!r} of type {type(model).__name__}"
        if isinstance(model, keras.Model)
        else f"model={model!r} of type {type(model).__name__}"
    )
    return (
        "`model` must be a model that gradaccum accumulates for (returned by "
        f"`gradaccum.accumulate`). Received: {received}"
    )


def _install(model: keras.Model, accumulation: Accumulation) -> None:
    """Sets the instance attributes that route `model`'s training through
    `accumulation` (bypassing Keras's attribute tracking: they are not state)."""
    cls = type(model)

    def compile(*args: Any, **kwargs: Any) -> None:
        cls.compile(model, *args, **kwargs)
        _recompile(model, accumulation, user_config=kc.compile_config(model),
                   steps_per_execution_given="steps_per_execution" in kwargs)

    def fit(x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: Any = None, **kwargs: Any) -> Any:
        def own_fit(*args: Any, **kw: Any) -> Any:
            return cls.fit(model, *args, **kw)

        return accumulation.fit(own_fit, x, y, batch_size, epochs, verbose, callbacks, kwargs)

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        accumulation.before_evaluate(kwargs)
        with accumulation.evaluating():
            return cls.evaluate(model, *args, **kwargs)

    def predict(*args: Any, **kwargs: Any) -> Any:
        accumulation.before_predict(args, kwargs)
        return cls.predict(model, *args, **kwargs)

    def train_step(*args: Any) -> Any:
        # (data) on TensorFlow, (state, data) on JAX.
        return accumulation.train_step(*args)

    def train_on_batch(*args: Any, **kwargs: Any) -> Any:
        def own_train_on_batch(*a: Any, **kw: Any) -> Any:
            return cls.train_on_batch(model, *a, **kw)

        return accumulation.train_on_batch(own_train_on_batch, args, kwargs)

    def make_train_function(force: bool = False) -> Any:
        return accumulation.make_train_function(
            lambda force: cls.make_train_function(model, force=force), force
        )

    def save_weights(filepath: Any, overwrite: bool = True, *args: Any,
                     **kwargs: Any) -> None:
        # The weights and the window state as one pair, whatever a kill meets
        # (gradaccum.state_file); Keras's other arguments passed on as given.
        filepath = os.fspath(filepath)
        proceed, sharded = state_file.keras_save(filepath, overwrite, args, kwargs)
        if not proceed:
            return None
        store: dict[str, Any] = {}
        accumulation.save_to(store)
        with model_file.carrying(accumulation):
            state_file.save(
                lambda path: cls.save_weights(model, path, True, *args, **kwargs),
                filepath, store, _signature(model, accumulation), sharded=sharded)
        return None

    def load_weights(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        # The state first: one that does not belong here changes nothing (unless
        # the weights file itself is unreadable: then Keras's OSError, which
        # BackupAndRestore(double_checkpoint=True) answers with its backup).
        skip_mismatch = bool(args[0] if args else kwargs.get("skip_mismatch", False))
        try:
            store = state_file.load(filepath, _signature(model, accumulation),
                                    skip_mismatch=skip_mismatch)
        except ValueError:
            state_file.check_readable(filepath)
            raise
        result = cls.load_weights(model, filepath, *args, **kwargs)
        if store is not None:
            accumulation.load_from(store)
        return result

    def save(filepath: Any, overwrite: bool = True, zipped: bool | None = None,
             **kwargs: Any) -> Any:
        # Keras's file, with the accumulation state inside (gradaccum.model_file).
        with model_file.carrying(accumulation):
            return model_file.save(
                model, accumulation,
                lambda path, overwrite: cls.save(model, path, overwrite=overwrite,
                                                 zipped=zipped, **kwargs),
                filepath, overwrite, zipped, kwargs, _signature(model, accumulation))

    def save_own_variables(store: Any) -> Any:
        model_file.storing(accumulation)
        return cls.save_own_variables(model, store)

    for name, method in (
        ("compile", compile),
        ("fit", fit),
        ("evaluate", evaluate),
        ("predict", predict),
        ("train_step", train_step),
        ("make_train_function", make_train_function),
        ("train_on_batch", train_on_batch),
        ("save_weights", save_weights),
        ("load_weights", load_weights),
        ("save", save),
        ("save_own_variables", save_own_variables),
        (ATTRIBUTE, accumulation),
    ):
        model.__dict__[name] = method
    if accumulation.options.split:
        model.__dict__[_SIZE] = accumulation.micro_batch_size


def _signature(model: keras.Model, accumulation: Accumulation) -> dict:
    """Which model and window rule a saved window state is for."""
    return {
        # The trainable variables in order, by shape (paths change from one
        # instance of a model to the next; Keras loads weights by structure).
        "model": [list(v.shape) for v in model.trainable_variables],
        # Their paths: where the same variables come in another order (a quantized
        # layer loaded from a file builds its scales before its kernel), the saved
        # window follows them (`state_file.reordered`).
        "paths": [v.path for v in model.trainable_variables],
        "window": accumulation.options.rule(),
    }


def _recompile(model: keras.Model, accumulation: Accumulation, *, user_config: dict | None,
               steps_per_execution_given: bool) -> None:
    """Compiles `model` again as its own compile did, with the losses recording
    their normalizers and the window as `steps_per_execution`; the model keeps
    the user's compile as the one it saves."""
    if user_config is None:
        return
    accumulation.user_compile_config = user_config
    check_optimizer(model.optimizer)
    config = dict(user_config, optimizer=model.optimizer)
    if (accumulation.options.weighting == "exact" and accumulation.options.privacy is None
            and config.get("loss") is not None):
        config["loss"] = record_normalizers(config["loss"], accumulation.normalizers,
                                            accumulation.options.reduction)
    accumulation.chose_steps_per_execution = not steps_per_execution_given
    if not steps_per_execution_given:
        config["steps_per_execution"] = accumulation.default_steps_per_execution()
    keras.Model.compile(model, **config)
    kc.set_compile_config(model, user_config)
    accumulation.forget()
