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

# At most this many samples of the data's first batch probe `fit`'s model.
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


def probe(model, x, batch_size=None) -> tuple:
    """The layers of `model` whose `add_loss` term is summed over the batch, found on
    the first samples of `fit`'s `x` (arrays, a `tf.data.Dataset`, a
    `keras.utils.PyDataset`, a Python generator; data the model cannot be called on
    as it is finds nothing), and the `x` to train on (a generator's first batch is
    read, and given back in front of the rest). Changes no variable or random
    state."""
    if inspect.isgenerator(x):
        x, first = _peeked(x)
        batch = None if first is None else _first_inputs(first[0], batch_size)
    else:
        batch = _first_inputs(x, batch_size)
    return (_summed_on(model, batch) if batch is not None and model.built else []), x


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


def _first_inputs(x, batch_size):
    """The inputs of at most `PROBE_SAMPLES` samples of the data's first batch, as
    arrays (None where the source cannot be read without consuming it)."""
    try:
        if isinstance(x, keras.utils.PyDataset):
            first = x[0]
            inputs = first[0] if isinstance(first, tuple) else first
        elif hasattr(x, "take") and hasattr(x, "element_spec"):  # a tf.data.Dataset
            for element in x.take(1):
                inputs = element[0] if isinstance(element, tuple) else element
                break
            else:
                return None
            inputs = keras.tree.map_structure(np.asarray, inputs)
        else:
            inputs = x
            flat = keras.tree.flatten(inputs) if inputs is not None else []
            if not flat or not all(hasattr(t, "shape") and len(t.shape) for t in flat):
                return None
        flat = keras.tree.flatten(inputs)
        if not flat or not hasattr(flat[0], "shape") or not len(flat[0].shape):
            return None
        count = min(len(flat[0]), batch_size or PROBE_SAMPLES, PROBE_SAMPLES)
        return _rows(inputs, 0, count)
    except Exception:  # noqa: BLE001 (an input of another kind: no probe)
        return None


def _rows(inputs, start, end):
    return keras.tree.map_structure(lambda t: t[start:end], inputs)


class Snapshot:
    """Every variable of a model and its optimizers, and the random state Keras
    draws unseeded numbers from (its global seed generator, Python's `random`,
    which seeds a new one), to put back."""

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
