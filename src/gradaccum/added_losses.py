"""A layer's `add_loss` term summed over the batch (not averaged per sample): the one
loss term accumulation cannot weigh exactly, since the large batch's term is the sum
of the micro-batches' where accumulation averages them. `audit` names it and `fit`
warns of it once, with the same words (`cause`), each from a few forward passes in
training mode on a batch and its halves, with every variable and random state put
back afterwards (`Snapshot`).
"""

from __future__ import annotations

import inspect
import random

import keras
import numpy as np

from gradaccum import _keras_common as kc

# At most this many samples probe `fit`'s model.
PROBE_SAMPLES = 8


def cause(layer) -> str:
    """What `audit` says and `fit` warns of a summed term of `layer`."""
    return (
        f"A loss term of layer {layer.name!r} (`add_loss`) is summed over the "
        "batch, not averaged per sample: the large batch's term is the sum of "
        "the micro-batches', and accumulation averages them. Divide it by the "
        "batch size."
    )


def terms(model, x) -> list:
    """`(layer, value)` of each `add_loss` term of the model's layers on `x` (a
    forward pass in training mode)."""
    model(x, training=True)
    found = []
    for layer in kc.flatten_layers(model):
        for loss in getattr(layer, "_losses", []):
            found.append((layer, float(keras.ops.convert_to_numpy(loss))))
    return found


def summed(whole: list, parts: list, sizes) -> list:
    """The layers whose term on the whole batch (`whole`, from `terms`) is the sum of
    its terms on the parts (`parts`: `terms` of each, of `sizes` samples), not their
    mean per sample."""
    if any(len(part) != len(whole) for part in parts):
        return []
    layers = []
    for j, (layer, value) in enumerate(whole):
        values = [part[j][1] for part in parts]
        mean = float(np.dot(values, sizes) / sum(sizes))
        total = float(np.sum(values))
        scale = max(abs(value), 1e-12)
        if abs(value - mean) > 1e-4 * scale and abs(value - total) <= 1e-4 * scale:
            layers.append(layer)
    return layers


def probe(model, x) -> tuple:
    """The layers of `model` whose `add_loss` term is summed over the batch, and the
    `x` to train on. The probe's inputs: the first samples of arrays; a Python
    generator's first batch (read, and given back in front of the rest); else (a
    `tf.data.Dataset`, a `keras.utils.PyDataset`: reading them would move their
    shuffling and augmentation) inputs made up from the model's input shapes and
    dtypes with a generator of the probe's own. A model not built, whose layers'
    classes never call `add_loss` (`may_add_losses`), or that cannot be called on
    the inputs as given (a task whose preprocessing runs in `fit`), finds nothing.
    Changes no variable or random state."""
    if not model.built or not may_add_losses(model):
        return [], x
    batch = None
    if inspect.isgenerator(x):
        x, first = _peeked(x)
        if first is not None:
            batch = _first_rows(first[0])
    elif not (isinstance(x, keras.utils.PyDataset) or _is_dataset(x)):
        batch = _first_rows(x)
    if batch is None:
        batch = _made_up(model)
    return (_summed_on(model, batch) if batch is not None else []), x


# Layers of these packages add no loss summed over the batch (Keras's activity
# regularizers are divided by the batch size).
_KNOWN = ("keras.", "keras_hub.", "keras_nlp.", "tensorflow.", "tf_keras.", "builtins")


def may_add_losses(model) -> bool:
    """Whether a class of the model's layers (the model's own included) outside
    Keras and KerasHub may call `add_loss`: its source names it, or is not readable.
    The probe calls no other model (a forward pass a model's own code could see)."""
    seen = set()
    for layer in kc.flatten_layers(model):
        for cls in type(layer).__mro__:
            if cls.__module__.startswith(_KNOWN) or cls in seen:
                break
            seen.add(cls)
            try:
                source = inspect.getsource(cls)
            except (OSError, TypeError):
                return True
            if "add_loss" in source:
                return True
    return False


def _is_dataset(x) -> bool:
    return hasattr(x, "take") and hasattr(x, "element_spec")


def _peeked(generator):
    """`(a generator of the same batches, the first batch as a 1-tuple)`: the first
    None where the generator is spent."""
    try:
        first = next(generator)
    except StopIteration:
        return generator, None

    def again():
        yield first
        yield from generator

    inputs = first[0] if isinstance(first, tuple) else first
    return again(), (inputs,)


def _first_rows(inputs):
    """At most `PROBE_SAMPLES` first samples of array inputs (None: fewer than 2,
    or not arrays)."""
    try:
        flat = keras.tree.flatten(inputs) if inputs is not None else []
        if not flat or not all(hasattr(t, "shape") and len(t.shape) for t in flat):
            return None
        if len(flat[0]) < 2:
            return None
        return _rows(inputs, 0, min(len(flat[0]), PROBE_SAMPLES))
    except Exception:  # noqa: BLE001 (an input of another kind: no probe)
        return None


def _made_up(model):
    """`PROBE_SAMPLES` inputs of the model's input shapes and dtypes (normal floats
    from the probe's own generator, integers 0), or None where the model has no
    known inputs or one of another kind."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    rng = np.random.default_rng(0)

    def made(spec):
        shape = (PROBE_SAMPLES, *spec.shape[1:])
        if any(d is None for d in shape):
            raise ValueError("an input of unknown shape")
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if "float" in dtype:
            return rng.normal(size=shape).astype(dtype)
        if "int" in dtype or dtype == "bool":
            return np.zeros(shape, dtype)
        raise ValueError(f"an input of dtype {dtype}")

    try:
        made_up = [made(spec) for spec in inputs]
    except ValueError:
        return None
    return made_up[0] if len(made_up) == 1 else made_up


def _summed_on(model, batch) -> list:
    """`summed` on a batch of inputs and its two halves."""
    size = len(keras.tree.flatten(batch)[0])
    if size < 2:
        return []
    half = size // 2
    saved = Snapshot(model)
    try:
        whole = terms(model, batch)
        if not whole:
            return []
        parts = [terms(model, _rows(batch, 0, half)), terms(model, _rows(batch, half, size))]
    except Exception:  # noqa: BLE001 (a model called otherwise: nothing found)
        return []
    finally:
        saved.restore()
    return summed(whole, parts, [half, size - half])


def _rows(inputs, start, end):
    return keras.tree.map_structure(lambda t: t[start:end], inputs)


class Snapshot:
    """Every variable of a model and its optimizers, and the random state Keras
    draws unseeded numbers from (its global seed generator, Python's `random`,
    which seeds a new one) and NumPy's global one, to put back."""

    def __init__(self, model):
        from keras.src.backend.common import global_state

        variables = list(model.variables)
        if getattr(model, "optimizer", None) is not None:
            variables += list(model.optimizer.variables)
        for _, optimizer in kc.named_optimizers(model):
            variables += list(optimizer.variables)
        seen, self.variables = set(), []
        for variable in variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                self.variables.append(variable)
        self.values = [np.array(v.numpy()) for v in self.variables]
        self._global_state = global_state
        self.generator = global_state.get_global_attribute("global_seed_generator")
        self.generator_state = (None if self.generator is None
                                else np.array(self.generator.state.numpy()))
        self.python_random = random.getstate()
        self.numpy_random = np.random.get_state()

    def restore(self) -> None:
        for variable, value in zip(self.variables, self.values):
            variable.assign(value)
        if self.generator is None:
            self._global_state.set_global_attribute("global_seed_generator", None)
        else:
            self._global_state.set_global_attribute("global_seed_generator",
                                                    self.generator)
            self.generator.state.assign(self.generator_state)
        random.setstate(self.python_random)
        np.random.set_state(self.numpy_random)
