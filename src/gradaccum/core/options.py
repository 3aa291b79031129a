"""The accumulation options, declared once for `accumulate` and `wrap` on every
backend.

`OPTIONS` is the one list of the options `gradaccum.accumulate`, `gradaccum.wrap`
and `AccumulatingModel` take: each one's name, default and the words of its
documentation; `AccumulationOptions` is their types, the signature the doors take
as `**options` (PEP 692: type checkers and editors read each name and type there).
`takes_options` gives a door the whole signature (`help`, `inspect.signature`) and
its docstring's `Args:`; `Options` checks the values once, with fixed-form errors,
and writes a saved model's config (`Options.config`).
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypedDict, TypeVar

import keras

from gradaccum.core.combine import REDUCTIONS
from gradaccum.core.hints import DType, Integer, Nonfinite, Real, Steps, Weighting
from gradaccum.core.moving_statistics import MODES as MOVING_MODES
from gradaccum.core.noise_scale import NoiseScaleSchedule
from gradaccum.core.policy import Policy
from gradaccum.core.privacy import PRIVACY_FIELDS, Privacy, check_privacy
from gradaccum.core.privacy import check_options as check_private_options
from gradaccum.core.validation import (
    accumulator_dtype_name,
    check_choice,
    check_noise_scale,
    check_nonfinite,
    check_weighting,
    check_window_options,
)
from gradaccum.core.window import PARTIALS, ScheduleRunner, WindowRule

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover
    from typing_extensions import Unpack

_Function = TypeVar("_Function", bound=Callable[..., Any])


class Option(NamedTuple):
    """One option: its name, default and documentation (an `Args:` entry)."""

    name: str
    default: object
    doc: str


OPTIONS = (
    Option("steps", None, """
        micro-batches per update (k), an integer >= 1; or a schedule of k by update
        index (counted from 0, saved with the state): sorted `(from_update, k)` pairs
        starting at 0, such as `[(0, 1), (2, 2), (4, 4)]`, or a callable
        `update_index -> int` (traced in the step: TensorFlow runs it through
        AutoGraph, JAX traces it as it is), or a `gradaccum.NoiseScaleSchedule`
        (k follows the gradient noise scale). A window's length is read when it
        opens."""),
    Option("micro_batch_size", None, """
        instead of `steps`, split mode: each batch the training step receives is cut
        into micro-batches of at most this many samples and makes one update; or
        `"auto"`, the largest size that runs without an out-of-memory error (a step
        that runs out of memory is rolled back and run again with smaller
        micro-batches)."""),
    Option("max_micro_batch_size", None, """
        with `"auto"`, the largest micro-batch to try."""),
    Option("weight_per_update", None, """
        instead of `steps`, a weight budget: a window closes at the first
        micro-batch after which its total weight reaches it (with
        `weighting="exact"` the weight is the loss normalizer: a per-token loss gets
        about that many tokens per update)."""),
    Option("weighting", "exact", """
        `"exact"` (default): each micro-batch weighs its loss normalizer (its number
        of loss elements, unmasked elements, or sample-weight sum), so unequal
        micro-batches, sample and class weights, masks and unequal sequence lengths
        give the large-batch gradient. `"uniform"`: the plain mean (as Keras's
        built-in accumulation). Or a callable `(x, y, sample_weight) -> weight`
        returning a scalar >= 0."""),
    Option("partial", "flush", """
        what happens to a window the data ends in the middle of (the end of an epoch
        and of fit): `"flush"` (default) applies it normalized by its own weight,
        `"carry"` keeps it open into the next epoch, `"drop"` discards it."""),
    Option("reduction", "mean", """
        `"mean"` (default): the weighted mean of the micro-batch gradients, or
        `"sum"`: their sum (the learning rate then scales with the window)."""),
    Option("accumulator_dtype", "float32", """
        dtype of the accumulators (float32 by default, whatever the variables' or
        gradients' dtype)."""),
    Option("nonfinite", "skip", """
        a micro-batch whose gradient holds an inf or a nan is `"skip"`ped (default:
        dropped with its weight, counted in the logs' `skipped`, a warning once),
        makes fit `"raise"` an error naming it, or is `"apply"`ed as Keras would; or
        a callable `gradients -> bool` that says which micro-batches to skip (as
        optax's `should_skip_update_fn`). Under loss scaling an overflowing
        micro-batch is always skipped and the scale backs off."""),
    Option("moving_statistics", "window", """
        Keras's own `BatchNormalization` layers: `"window"` (default) moves their
        moving mean and variance once per update, from the window's pooled
        statistics (what the window trained as one batch records), recovered from
        each micro-batch's move; each micro-batch is still normalized with its own
        statistics in the forward pass (ghost batch normalization). A layer that
        cannot be followed (renorm, a custom layer that moves its own statistics) is
        named in a warning. `"micro_batch"`: Keras's behaviour, a move per
        micro-batch."""),
    Option("sums", "local", """
        where the window's sums sit across the devices of a keras.distribution's
        batch axis (JAX; N devices): `"local"` (default): each device adds its own
        share of every micro-batch into whole sums of its own, and the devices' sums
        are added once per update (one all-reduce). `"sharded"`: each device keeps
        1/N of the sums, the devices' gradients reduce-scattered into them at every
        micro-batch. `"reduced"`: each micro-batch's gradient is all-reduced before
        it is added (Keras's own step's communication: for a loss that compares a
        micro-batch's samples with each other, such as in-batch negatives). On one
        device the three are the same."""),
    Option("noise_scale", False, """
        `True`: each epoch's logs (and so `History` and every callback) get
        `noise_scale`, the gradient noise scale B_simple in samples, estimated from
        the epoch's windows (their micro-batches' gradients against the window's:
        the critical batch size's estimate, see the guide "Choosing k"). Needs
        windows of two micro-batches or more, or several replicas; training is
        unchanged."""),
    Option("privacy", None, """
        a `gradaccum.Privacy`: differentially private training (DP-SGD), each
        example's gradient clipped, the noise added once per window (see there).
        Needs Keras's default train step and the compiled loss."""),
)
NAMES = tuple(option.name for option in OPTIONS)
# Where the sums sit across a distribution's data-parallel devices (`sums`).
SUMS = ("local", "sharded", "reduced")
DEFAULTS = {option.name: option.default for option in OPTIONS}


class AccumulationOptions(TypedDict, total=False):
    """The types of the options after `steps`, by keyword (`OPTIONS` holds their
    defaults and words): what `accumulate(model, steps, **options)`, `wrap` and
    `AccumulatingModel` take."""

    micro_batch_size: Integer | str | None
    max_micro_batch_size: Integer | None
    weight_per_update: Real | None
    weighting: Weighting
    partial: str
    reduction: str
    accumulator_dtype: DType
    nonfinite: Nonfinite
    moving_statistics: str
    sums: str
    noise_scale: bool
    privacy: Privacy | None


#: Each option's type as written (`steps` is a door's own parameter: its second).
TYPES = {"steps": "Steps | None", **{
    name: getattr(hint, "__forward_arg__", hint)
    for name, hint in AccumulationOptions.__annotations__.items()}}


def given(values: Mapping[str, Any], name: str = "Options") -> dict:
    """`values`, keyword arguments a door `name` received as `**options`; raises a
    TypeError, as Python does, for a name that is no option."""
    unknown = [key for key in values if key not in DEFAULTS or key == "steps"]
    if unknown:
        raise TypeError(f"{name}() got an unexpected keyword argument {unknown[0]!r}")
    return dict(values)


def takes_options(function: _Function) -> _Function:
    """Gives `function` (a door: `accumulate`, `wrap`, `AccumulatingModel.__init__`)
    the options' signature in place of its `**options` (or before its `**kwargs`),
    each with its type and default, so `help`, `inspect.signature` and Keras's
    config see every option; fills its docstring's `{options}` line (`filled`).
    Returns `function`. (Under `python -OO` there is no docstring to fill.)"""
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    tail = parameters.pop() if parameters[-1].kind is inspect.Parameter.VAR_KEYWORD else None
    present = {p.name for p in parameters}
    parameters += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[name],
                          annotation=TYPES[name])
        for name in NAMES if name not in present
    ]
    if tail is not None and tail.name != "options":
        # What else the door passes on (Keras's `Model` arguments).
        parameters.append(tail.replace(annotation="Any"))
    function.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=sorted(parameters, key=lambda p: p.kind))
    if function.__doc__ is not None:
        function.__doc__ = filled(function.__doc__)
    return function


def filled(docstring: str) -> str:
    """`docstring` with its `{options}` line replaced by the options' `Args:`
    entries, at that line's indentation. The API page's griffe extension
    (docs/griffe_options.py) calls it on the source's docstrings."""
    lines = docstring.splitlines()
    index = next(i for i, line in enumerate(lines) if line.strip() == "{options}")
    indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
    entries = []
    for option in OPTIONS:
        text = " ".join(option.doc.split())
        body = textwrap.wrap(f"{option.name}: {text}", width=88 - len(indent),
                             subsequent_indent="    ", break_on_hyphens=False)
        entries += [indent + line for line in body]
    return "\n".join(lines[:index] + entries + lines[index + 1:])


def check_signature(function: Callable[..., Any], *, skip: int = 1) -> None:
    """Raises unless `function` takes every option with its default (after its first
    `skip` parameters): a signature that drifted from `OPTIONS`."""
    parameters = list(inspect.signature(function).parameters.values())[skip:]
    found = {p.name: p.default for p in parameters if p.name in DEFAULTS}
    if found != DEFAULTS:
        raise TypeError(
            f"{function.__qualname__} must take the options of gradaccum.core.options "
            f"with their defaults. Received: {found}"
        )


class Options:
    """The accumulation options, checked once (fixed-form errors).

    One of `steps` (each batch is a micro-batch; `steps` of them make an update,
    `steps` an integer or a schedule by update index), `weight_per_update` (each
    batch is a micro-batch; a window closes once its total weight reaches the
    budget) or `micro_batch_size` (split mode: each batch is split into
    micro-batches of at most that many samples, or `"auto"`, and makes one update).
    The other options are `OPTIONS`'. `runner` is the backend's (how its step runs
    a `steps` callable: `core.window.ScheduleRunner`); the backend's adapter makes
    the options (`Accumulation.checked_options`) and adds its own checks.
    """

    def __init__(self, *, runner: ScheduleRunner | None = None, steps: Steps | None = None,
                 **options: Unpack[AccumulationOptions]) -> None:
        values = {**DEFAULTS, **given(options)}
        partial, weighting, reduction = (values["partial"], values["weighting"],
                                         values["reduction"])
        self.partial = check_choice("partial", partial, PARTIALS)
        self.micro_batch_size, self.max_micro_batch_size = check_window_options(
            steps, values["micro_batch_size"], values["max_micro_batch_size"], partial,
            values["weight_per_update"]
        )
        # When a window closes, checked now (a schedule's callable is tried on
        # update 0) and shared by every accumulator of the fit.
        self.window = WindowRule(steps, values["weight_per_update"], runner)
        self.weighting = check_weighting(weighting)
        self.reduction = check_choice("reduction", reduction, REDUCTIONS)
        self.accumulator_dtype = accumulator_dtype_name(values["accumulator_dtype"])
        self.nonfinite = check_nonfinite(values["nonfinite"])
        self.moving_statistics = check_choice("moving_statistics",
                                              values["moving_statistics"], MOVING_MODES)
        if self.auto and (self.weighting == "uniform" or self.reduction == "sum"):
            raise ValueError(
                '`weighting` must be "exact" or a callable, and `reduction` "mean", '
                'with micro_batch_size="auto": "auto" changes the split, which must not '
                f"change the update. Received: weighting={weighting!r}, "
                f"reduction={reduction!r}"
            )
        self.sums = check_choice("sums", values["sums"], SUMS)
        # Differentially private training (`gradaccum.Privacy`), or None.
        self.privacy = check_privacy(values["privacy"])
        # A `NoiseScaleSchedule` follows the noise scale: it needs its estimate.
        self.noise_scale = check_noise_scale(
            values["noise_scale"] or self.window.follows, self.reduction, self.privacy)
        if self.privacy is not None:
            check_private_options(self)

    def policy(self) -> Policy:
        """The settings the state machine follows (`core.policy.Policy`)."""
        return Policy(self.window, self.reduction, self.nonfinite, self.partial,
                      self.weighting)

    @property
    def follows_moving_statistics(self) -> bool:
        """Whether Keras's BatchNormalization layers follow the window
        (`moving_statistics="window"`; with windows of one micro-batch they move as
        Keras moves them, but not for a skipped micro-batch)."""
        return self.moving_statistics == "window"

    @property
    def split(self) -> bool:
        """Whether each batch is split into micro-batches (one update per batch)."""
        return self.micro_batch_size is not None

    @property
    def auto(self) -> bool:
        return self.micro_batch_size == "auto"

    @property
    def steps(self) -> Any:
        """`steps` as checked: an int, the schedule (pairs as a tuple, or the
        callable), or None."""
        return self.window.steps

    @property
    def weight_per_update(self) -> float | None:
        return self.window.weight_per_update

    def rule(self) -> dict:
        """What a saved window means, as plain values: when it closes (`steps`, a
        schedule, a budget, split mode), how its micro-batches are weighed and
        combined, and whether it is private. A saved state goes on only under the
        same rule."""

        def named(value: Any) -> Any:
            if isinstance(value, NoiseScaleSchedule):
                return {"NoiseScaleSchedule": value.get_config()}
            if callable(value):
                return getattr(value, "__qualname__", type(value).__qualname__)
            if isinstance(value, (list, tuple)):
                return [named(v) for v in value]
            return value

        return {
            "steps": named(self.steps),
            "weight_per_update": self.weight_per_update,
            "split": self.split,
            "weighting": named(self.weighting),
            "reduction": self.reduction,
            "private": self.privacy is not None,
        }

    def config(self) -> dict:
        """The options as a saved model's config holds them: names as they are,
        pairs as lists, a callable as Keras serializes it (registered with
        `keras.saving.register_keras_serializable` to load), `privacy` as the dict
        of its arguments (the seed included: None draws a new one)."""
        config = {}
        for name in NAMES:
            value = getattr(self, name)
            if name == "privacy" and value is not None:
                value = {field: getattr(value, field) for field in PRIVACY_FIELDS}
            elif isinstance(value, tuple):
                value = [list(pair) for pair in value]
            elif isinstance(value, NoiseScaleSchedule):
                value = keras.saving.serialize_keras_object(value)
            elif callable(value):
                value = keras.saving.serialize_keras_object(value)
            config[name] = value
        return config

    @staticmethod
    def from_config(config: dict, custom_objects: dict[str, Any] | None = None) -> dict:
        """The options' values out of `config()` (callables deserialized)."""
        values = {}
        for name in NAMES:
            if name not in config:
                continue
            value = config[name]
            if name == "privacy" and isinstance(value, dict):
                value = Privacy(**value)
            elif isinstance(value, dict):
                value = keras.saving.deserialize_keras_object(
                    value, custom_objects=custom_objects
                )
            values[name] = value
        return values
