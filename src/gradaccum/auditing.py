"""`gradaccum.audit`: how far one window's accumulated gradient is from the large
batch's, per variable, and what in the model makes them differ.

The audit runs the model's own training step (Keras's, or the class's `train_step`)
through gradaccum twice on one window of `steps` micro-batches of `batch_size`
samples: once with the window as one micro-batch (the gradient plain Keras's step
takes on the large batch) and once micro-batch by micro-batch (what `accumulate`
combines). Neither run updates anything: the window never closes, and every
variable (weights, batch statistics, random seeds, the optimizer's state) is put back
as it was; the compiled metrics start again, as at each `fit`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import Any

import keras
import numpy as np

from gradaccum import _keras_common as kc
from gradaccum import added_losses
from gradaccum.adapter import accumulation_of
from gradaccum.backend_interface import Findings
from gradaccum.core import messages, overwrite
from gradaccum.core.hints import Integer, Weighting
from gradaccum.core.moving_statistics import unfollowable_reason, window_aware
from gradaccum.core.screening import skipped_message
from gradaccum.core.validation import check_choice, check_steps
from gradaccum.weighting import uniform_message

# Relative differences up to this are float32 noise (sums in another order); a
# model computing in float16 or bfloat16 (mixed precision) has that dtype's noise.
TOLERANCE = 1e-4
TOLERANCES = {"float16": 1e-2, "bfloat16": 5e-2}
# A variable's gradient is measured against at least this fraction of the model's
# largest gradient.
FLOOR = 1e-3


class AuditReport:
    """What `gradaccum.audit` found.

    Attributes:
        rows: one `(variable path, largest |difference|, largest |large-batch
            gradient|, relative difference)` per trainable variable. The relative
            difference divides by the larger gradient's largest value, or by 1e-3 of
            the model's largest gradient where that is more (a gradient that is zero
            in theory, an attention key bias's, holds float noise only).
        max_difference: the largest relative difference over the variables.
        exact: whether `max_difference` is rounding noise (<= `tolerance`: 1e-4,
            1e-2 for a model computing in float16, 5e-2 in bfloat16), and the step
            updates nothing between its optimizer calls of one batch (it applies one
            optimizer, once).
        causes: what in the model makes accumulation differ from the large batch,
            each naming its layer, term or option (empty when none is found).
        micro_batch_sizes: the samples of each micro-batch of the window audited.
        rules: what the window does with variables whose "gradient" is their new
            value (`overwrite_with_gradient`: float8's scales and amax histories),
            one line per float8 layer or other such variable (empty when none).
    """

    def __init__(self, rows: list[tuple[str, float, float, float]], causes: list[str],
                 micro_batch_sizes: list[int], tolerance: float = TOLERANCE,
                 updates_between_calls: bool = False, rules: Iterable[str] = ()) -> None:
        self.rows = rows
        self.causes = causes
        self.rules = list(rules)
        self.micro_batch_sizes = micro_batch_sizes
        self.tolerance = tolerance
        self.max_difference = max((row[3] for row in rows), default=0.0)
        # A step that applies optimizers several times per batch updates between
        # its calls on the large batch: not exact, whatever the first gradients say.
        self.exact = self.max_difference <= tolerance and not updates_between_calls

    def __repr__(self) -> str:
        return (f"AuditReport(exact={self.exact}, max_difference={self.max_difference:.3g}, "
                f"causes={len(self.causes)})")

    def __str__(self) -> str:
        sizes = " + ".join(str(n) for n in self.micro_batch_sizes)
        verdict = "exact (rounding noise)" if self.exact else "NOT exact"
        lines = [
            f"gradaccum audit: one window of {len(self.micro_batch_sizes)} micro-batches "
            f"({sizes} samples) against the same window as one batch: {verdict}, largest "
            f"relative difference {self.max_difference:.3g} (tolerance {self.tolerance:g})",
            "",
        ]
        width = max([len("variable")] + [len(row[0]) for row in self.rows])
        lines.append(f"{'variable':<{width}}  {'max |diff|':>10}  {'max |grad|':>10}  "
                     f"{'relative':>10}")
        for path, difference, scale, relative in self.rows:
            lines.append(f"{path:<{width}}  {difference:>10.3g}  {scale:>10.3g}  "
                         f"{relative:>10.3g}")
        lines.append("")
        if self.rules:
            lines.append("Rules:")
            lines += [f"- {rule}" for rule in self.rules]
        if self.causes:
            lines.append("Causes:")
            lines += [f"- {cause}" for cause in self.causes]
        elif not self.exact:
            lines.append("Causes: none found in the model's layers, losses or options.")
        else:
            lines.append("Causes: none.")
        return "\n".join(lines)


def audit(model: keras.Model, x: Any, y: Any = None, *, steps: Integer, batch_size: Integer,
          sample_weight: Any = None, weighting: Weighting = "exact",
          reduction: str = "mean") -> AuditReport:
    """Compares one window's accumulated gradient with the large batch's.

    Takes the first `steps * batch_size` samples of the data as one window, and its
    gradient both ways: as `steps` micro-batches of `batch_size` samples combined by
    gradaccum, and as one batch, each through the model's own training step (`fit`'s:
    a KerasHub task preprocesses its strings). Trains nothing: the model's weights,
    batch statistics, random seeds and optimizer state are as they were afterwards
    (its compiled metrics start again, as at each `fit`).

    The large batch's gradient is the one the same step takes on the whole window
    as one micro-batch: what plain Keras's step computes there. A step that applies
    an optimizer several times per batch, or several optimizers (a GAN's), is
    reported not exact: on the large batch it would update between its calls.

    Args:
        model: a built, compiled Keras model (not under `gradaccum.accumulate`).
        x, y, sample_weight: the data, as `fit` takes them (arrays, dicts of them).
        steps: micro-batches per window (an integer >= 1).
        batch_size: samples per micro-batch (at most the number of samples). The
            window is the first `steps * batch_size` samples; where the data has
            fewer, its last micro-batch is shorter.
        weighting: the `weighting` accumulation would use (`"exact"`, `"uniform"` or
            a callable), as `accumulate` takes it.
        reduction: the `reduction` accumulation would use (`"mean"` or `"sum"`).

    Returns:
        An `AuditReport`: `report.exact`, `report.max_difference`, `report.causes`,
        and a table per variable in `str(report)`.

    Raises:
        ValueError: a model that is not a compiled, built Keras model or is under
            `accumulate`; `steps` or `batch_size` < 1; data that is not arrays (a
            dataset or a generator); data with fewer than `batch_size` samples, or
            too few for `steps` micro-batches.

    Examples:

        >>> import keras, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "relu"),
        ...                           keras.layers.Dropout(0.5), keras.layers.Dense(2)])
        >>> model.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
        >>> x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
        >>> y = np.arange(32) % 2
        >>> report = gradaccum.audit(model, x, y, steps=4, batch_size=8)
        >>> report.exact
        False
        >>> report.causes[0].startswith("Dropout layer")
        True
    """
    from gradaccum.attach import accumulate, disable

    check_model(model)
    k: int = check_steps(steps)
    size: int = check_steps(batch_size, name="batch_size")
    if not callable(weighting):
        check_choice("weighting", weighting, ("exact", "uniform"))
    check_choice("reduction", reduction, ("mean", "sum"))
    data = tuple(_as_arrays(part, name) for part, name in
                 ((x, "x"), (y, "y"), (sample_weight, "sample_weight")))
    samples = _samples(data[0])
    if size > samples:
        raise ValueError(
            "`batch_size` must be at most the number of samples audited. Received: "
            f"batch_size={size} for {samples} samples"
        )
    if -(-samples // size) < k:
        raise ValueError(
            "`steps` micro-batches of `batch_size` samples must fit in the data "
            f"audited. Received: steps={k}, batch_size={size} for {samples} "
            f"samples ({-(-samples // size)} micro-batches)"
        )
    end = min(k * size, samples)
    bounds = [(start, min(start + size, end)) for start in range(0, end, size)]
    window = _sliced(data, 0, end)
    micro_batches = [_sliced(data, a, b) for a, b in bounds]
    sizes = [b - a for a, b in bounds]

    optimizer = model.optimizer
    if not optimizer.built:
        # In the model's distribution scope, where fit builds it.
        with _scope(model):
            optimizer.build(model.trainable_variables)
    saved = added_losses.Snapshot(model)
    findings: dict[str, Any] = {}
    try:
        # Windows that never close: nothing is applied. The large batch is one
        # micro-batch of a window of 2, the micro-batches `len(bounds)` of one of
        # `2 * len(bounds)`: both halfway, so a float8 model differentiates the
        # same loss both ways (`transitions.loss_unit`).
        options = dict(partial="carry", weighting=weighting, reduction=reduction)
        large = _window_gradients(model, [window], dict(options, steps=2), findings)
        saved.restore()
        accumulated = _window_gradients(model, micro_batches,
                                        dict(options, steps=2 * len(bounds)), findings)
        saved.restore()
        summed_layers = _added_loss_terms(model, window, micro_batches, sizes)
    finally:
        if accumulation_of(model) is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                disable(model)
        saved.restore()
    del accumulate

    pairs = []
    for variable in model.trainable_variables:
        a, b = large.get(id(variable)), accumulated.get(id(variable))
        either = a if a is not None else b
        if either is None or not np.size(either):
            continue
        zeros = np.zeros(variable.shape, "float64")
        pairs.append((variable.path, zeros if a is None else a.astype("float64"),
                      zeros if b is None else b.astype("float64")))
    # A gradient far below the model's largest (zero in theory, as an attention key
    # bias's) is measured against FLOOR of the largest: its float noise is not a
    # difference.
    largest = max((float(np.max(np.abs(a))) for _, a, _ in pairs), default=0.0)
    rows = []
    for path, a, b in pairs:
        difference = float(np.max(np.abs(a - b)))
        scale = float(np.max(np.abs(a)))
        reference = max(scale, float(np.max(np.abs(b))), FLOOR * largest)
        relative = difference / reference if reference > 0 else 0.0
        rows.append((path, difference, scale, relative))
    tolerance = _tolerance(model)
    inexact = max((row[3] for row in rows), default=0.0) > tolerance
    causes = _causes(model, weighting, sizes, findings, summed_layers, inexact)
    between = (bool(findings.get("repeated")) or bool(findings.get("stale"))
               or (len(findings.get("optimizers", [])) > 1
                   and not findings.get("stale_known", True)))
    return AuditReport(rows, causes, sizes, tolerance=tolerance,
                       updates_between_calls=between, rules=overwrite.rules(model))


def _scope(model: keras.Model) -> contextlib.AbstractContextManager[Any]:
    """The model's tf.distribute scope (a no-op elsewhere)."""
    strategy = getattr(model, "distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _tolerance(model: keras.Model) -> float:
    """Rounding noise of the least precise dtype the model's layers compute in."""
    dtypes = {getattr(layer, "compute_dtype", None) for layer in kc.flatten_layers(model)}
    found = [TOLERANCES[d] for d in dtypes if d in TOLERANCES]
    return max(found, default=TOLERANCE)


def check_model(model: Any) -> None:
    if not isinstance(model, keras.Model):
        raise ValueError(
            "`model` must be a keras.Model. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
        raise ValueError(
            "`model` must be compiled (its loss and optimizer are what the audit "
            f"runs). Received: model {model.name!r} that is not compiled"
        )
    if not model.built:
        raise ValueError(
            "`model` must be built before it is audited (the audit puts every variable "
            f"back as it found it). Received: model {model.name!r} that is not built; "
            "give it an Input or call it on a batch first"
        )
    from gradaccum.keras_model import AccumulatingModel

    if accumulation_of(model) is not None and not isinstance(model, AccumulatingModel):
        raise ValueError(
            "`model` must be audited before `gradaccum.accumulate` (the audit runs its "
            f"own accumulation). Received: model {model.name!r} under accumulate; call "
            "`gradaccum.disable(model)` first"
        )


def _as_arrays(part: Any, name: str = "x") -> Any:
    """Data as `fit` reads it: arrays, and nests (dicts, lists) of arrays; a list of
    scalars (strings for a KerasHub task) is one array."""
    if part is None:
        return None
    if not isinstance(part, (dict, list, tuple)) and not hasattr(part, "shape"):
        raise ValueError(
            f"`{name}` must be arrays the audit can slice into micro-batches (numpy "
            "arrays or tensors, dicts or lists of them, a list of strings). Received: "
            f"{name} of type {type(part).__name__}; take a batch of it first "
            "(`next(iter(dataset))`)"
        )
    if isinstance(part, (list, tuple)) and part and all(
        np.ndim(item) == 0 for item in part
    ):
        return np.asarray(part)
    return keras.tree.map_structure(np.asarray, part)


def _samples(x: Any) -> int:
    first = keras.tree.flatten(x)[0] if x is not None else None
    if first is None or not np.ndim(first):
        raise ValueError(
            "`x` must be arrays the audit can slice into micro-batches (numpy arrays or "
            "tensors, dicts or lists of them, a list of strings). Received: x whose "
            f"first element is {type(first).__name__}"
        )
    return len(first)


def _sliced(data: tuple, start: int, end: int) -> tuple:
    return tuple(None if part is None
                 else keras.tree.map_structure(lambda t: t[start:end], part)
                 for part in data)


def _window_gradients(model: keras.Model, micro_batches: list[tuple], options: dict[str, Any],
                      findings: dict[str, Any]) -> dict[int, Any]:
    """Runs `micro_batches` through the model's step under `accumulate` (a window
    that does not close) and returns the window's combined gradient by variable id;
    records the accumulation's own findings (several applications of an optimizer
    per batch, loss terms whose normalizers are not proportional)."""
    from gradaccum.attach import accumulate, disable

    accumulate(model, **options)
    try:
        for x, y, sample_weight in micro_batches:
            # Through `fit`, as training runs it (a KerasHub task preprocesses there);
            # what it warns about, the report says.
            samples = len(keras.tree.flatten(x)[0])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.fit(x, y, sample_weight=sample_weight, batch_size=samples,
                          epochs=1, shuffle=False, verbose=0)
        accumulation = accumulation_of(model)
        gradients: dict[int, Any] = {}
        for variable, gradient in accumulation.window_gradients():
            if gradient is not None:
                # A variable two accumulators hold (an optimizer applied to lists
                # that overlap): the gradients its updates would use, summed.
                gradient = np.asarray(gradient)
                previous = gradients.get(id(variable))
                gradients[id(variable)] = (gradient if previous is None
                                           else previous + gradient)
        found = accumulation.findings()._asdict()
        findings["skipped"] = findings.get("skipped", 0) + found.pop("skipped")
        findings.update(found)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            disable(model)
    return gradients


def _added_loss_terms(model: keras.Model, window: tuple, micro_batches: list[tuple],
                      sizes: list[int]) -> list:
    """The layers whose `add_loss` term is summed over the batch, from forward passes
    in training mode on the window and on each micro-batch ([] where the model cannot
    be called on the data as given: a task whose preprocessing runs in `fit`)."""
    try:
        whole = added_losses.terms(model, window[0])
        parts = [added_losses.terms(model, x) for x, _, _ in micro_batches]
    except Exception:  # noqa: BLE001 (the check is skipped, the audit goes on)
        return []
    return added_losses.summed(whole, parts, sizes)


def _causes(model: keras.Model, weighting: Weighting, sizes: list[int],
            findings: dict[str, Any], summed_layers: list, inexact: bool) -> list[str]:
    causes = []
    for layer in kc.flatten_layers(model):
        if layer is model:
            continue
        if isinstance(layer, keras.layers.BatchNormalization):
            why = None if window_aware(layer) else unfollowable_reason(layer)
            moving = (
                "Its moving statistics follow the window (moved once per update from "
                "the pooled statistics, as the large batch moves them); the forward "
                "pass is the one difference left."
                if why is None else
                f"Its moving statistics move per micro-batch too: it cannot follow the "
                f"window ({why})."
            )
            causes.append(
                f"BatchNormalization layer {layer.name!r}: each micro-batch is normalized "
                "with its own mean and variance, the large batch with the window's, so "
                f"the gradients differ. {moving}"
            )
        elif _draws_random_numbers(layer):
            causes.append(
                f"{type(layer).__name__} layer {layer.name!r}: draws its random numbers "
                "for each micro-batch apart, not those the large batch draws; the "
                "accumulated gradient is the large batch's in expectation only."
            )
    causes += [added_losses.cause(layer) for layer in summed_layers]
    if findings:
        causes += [text for _, text in Findings(**{
            name: findings[name] for name in Findings._fields}).step_causes()]
    if findings.get("skipped"):
        causes.append(skipped_message(findings["skipped"]))
    if findings.get("inexact"):
        causes.append(messages.INEXACT)
    if weighting == "uniform" and (len(set(sizes)) > 1 or inexact):
        causes.append(uniform_message(sizes))
    return causes


# Attributes that set how much a layer's random draw changes its output: all zero
# (Dropout(0), an LSTM without dropout), the layer is deterministic.
_RANDOM_AMOUNTS = ("rate", "dropout", "recurrent_dropout", "stddev")


def _draws_random_numbers(layer: Any) -> bool:
    """Whether a layer draws random numbers in training (Dropout, GaussianNoise,
    recurrent dropout, random augmentation: a seed generator of its own, kept in an
    attribute or in a list or dict of them)."""
    generator = keras.random.SeedGenerator

    def generators(value: Any) -> bool:
        if isinstance(value, generator):
            return True
        if isinstance(value, (list, tuple)):
            return any(isinstance(item, generator) for item in value)
        if isinstance(value, dict):
            return any(isinstance(item, generator) for item in value.values())
        return False

    if not any(generators(value) for value in vars(layer).values()):
        return False
    amounts = [getattr(layer, name) for name in _RANDOM_AMOUNTS if hasattr(layer, name)]
    amounts = [a for a in amounts if isinstance(a, (int, float))]
    return not amounts or any(amounts)
