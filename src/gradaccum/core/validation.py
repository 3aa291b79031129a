"""Argument checks shared by the public API.

Every message has the fixed form ``"`name` must be <what>. Received: name=<value>"``,
so users see the argument, the rule and the value they passed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import keras
import numpy as np


def check_steps(steps, *, allow_none: bool = False, name: str = "steps"):
    """Returns `steps` as an int, or raises the fixed-form ValueError."""
    if steps is None and allow_none:
        return None
    if (
        isinstance(steps, bool)
        or not isinstance(steps, (numbers.Integral, np.integer))
        or int(steps) < 1
    ):
        raise ValueError(
            f"`{name}` must be an integer >= 1. Received: {name}={steps!r}"
        )
    return int(steps)


def check_steps_schedule(steps, *, allow_none: bool = False):
    """`steps` as an int, a callable `update_index -> int` (checked where it is
    first called), or a schedule of `(from_update, k)` pairs (a sequence, or an
    array of shape (n, 2)) returned as a tuple of int pairs; or raises the
    fixed-form ValueError."""
    if steps is None and allow_none:
        return None
    if callable(steps):
        return steps
    if isinstance(steps, np.ndarray) and steps.ndim == 2:
        steps = [tuple(pair) for pair in steps.tolist()]
    if isinstance(steps, Sequence) and not isinstance(steps, (str, bytes)):
        return check_step_pairs(steps)
    if not _is_int(steps) or int(steps) < 1:
        raise ValueError(
            "`steps` must be an integer >= 1, a list of `(from_update, k)` pairs or a "
            f"callable `update_index -> int`. Received: steps={steps!r}"
        )
    return int(steps)


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (numbers.Integral, np.integer))


def check_step_pairs(pairs) -> tuple:
    """A schedule of `(from_update, k)` pairs: from update `from_update` on (counted
    from 0), windows hold `k` micro-batches. Sorted, strictly increasing, starting at
    update 0."""
    if not pairs:
        raise ValueError(
            "`steps` pairs must be a non-empty list of `(from_update, k)` pairs. "
            f"Received: steps={pairs!r}"
        )
    checked = []
    for pair in pairs:
        if (
            not isinstance(pair, Sequence)
            or isinstance(pair, (str, bytes))
            or len(pair) != 2
            or not all(_is_int(n) for n in pair)
            or int(pair[0]) < 0
            or int(pair[1]) < 1
        ):
            raise ValueError(
                "`steps` pairs must be `(from_update, k)` with integers "
                f"from_update >= 0 and k >= 1. Received: steps={pairs!r}"
            )
        checked.append((int(pair[0]), int(pair[1])))
    starts = [start for start, _ in checked]
    if any(later <= earlier for earlier, later in zip(starts, starts[1:])):
        raise ValueError(
            "`steps` pairs must be sorted by `from_update`, each after the one before. "
            f"Received: steps={pairs!r}"
        )
    if starts[0] != 0:
        raise ValueError(
            "`steps` pairs must start at update 0 (the first window's length). "
            f"Received: steps={pairs!r}"
        )
    return tuple(checked)


def check_weight_per_update(weight_per_update):
    """Returns the weight budget as a float, None when not given, or raises."""
    if weight_per_update is None:
        return None
    if (
        isinstance(weight_per_update, bool)
        or not isinstance(weight_per_update, (numbers.Real, np.number))
        or not math.isfinite(float(weight_per_update))
        or float(weight_per_update) <= 0
    ):
        raise ValueError(
            "`weight_per_update` must be a finite number > 0. "
            f"Received: weight_per_update={weight_per_update!r}"
        )
    return float(weight_per_update)


def check_window_rule(steps, weight_per_update):
    """`steps` (a count or a schedule) or `weight_per_update` (a budget), not both.

    Returns:
        (steps, weight_per_update), checked.
    """
    if steps is not None and weight_per_update is not None:
        raise ValueError(
            "`steps` and `weight_per_update` cannot be used together: a window closes "
            "after `steps` micro-batches or once its total weight reaches "
            f"`weight_per_update`. Received: steps={steps!r}, "
            f"weight_per_update={weight_per_update!r}"
        )
    return check_steps_schedule(steps, allow_none=True), check_weight_per_update(
        weight_per_update
    )


def check_micro_batch_size(micro_batch_size, *, allow_none: bool = True):
    """Returns `micro_batch_size` as an int or `"auto"`, or raises the fixed-form
    ValueError."""
    if micro_batch_size is None and allow_none:
        return None
    if isinstance(micro_batch_size, str) and micro_batch_size == "auto":
        return "auto"
    if (
        isinstance(micro_batch_size, bool)
        or not isinstance(micro_batch_size, (numbers.Integral, np.integer))
        or int(micro_batch_size) < 1
    ):
        raise ValueError(
            '`micro_batch_size` must be an integer >= 1 or "auto". '
            f"Received: micro_batch_size={micro_batch_size!r}"
        )
    return int(micro_batch_size)


def check_window_options(steps, micro_batch_size, max_micro_batch_size, partial,
                         weight_per_update=None):
    """The window options together: `steps` (micro-batches per update, or a
    schedule of them), `weight_per_update` (a weight budget per update) or
    `micro_batch_size` (each batch split, one update per batch), exactly one; a cap
    only with `"auto"`; no partial window to treat in split mode. The values of
    `steps` and `weight_per_update` are `core.window.WindowRule`'s to check.

    Returns:
        (micro_batch_size, max_micro_batch_size), checked.
    """
    if steps is not None and micro_batch_size is not None:
        raise ValueError(
            "`steps` and `micro_batch_size` cannot be used together: `steps` counts "
            "the batches of one update, `micro_batch_size` splits each batch into "
            "micro-batches and updates once per batch. Received: "
            f"steps={steps!r}, micro_batch_size={micro_batch_size!r}"
        )
    if weight_per_update is not None and micro_batch_size is not None:
        raise ValueError(
            "`weight_per_update` and `micro_batch_size` cannot be used together: "
            "`weight_per_update` closes a window of batches once their weight reaches "
            "it, `micro_batch_size` makes each batch one window (let the data "
            "pipeline choose the batches to vary what an update holds). Received: "
            f"weight_per_update={weight_per_update!r}, "
            f"micro_batch_size={micro_batch_size!r}"
        )
    if steps is None and micro_batch_size is None and weight_per_update is None:
        raise ValueError(
            "`steps`, `weight_per_update` or `micro_batch_size` must be given. "
            "Received: steps=None, weight_per_update=None, micro_batch_size=None"
        )
    micro_batch_size = check_micro_batch_size(micro_batch_size)
    cap = check_steps(max_micro_batch_size, allow_none=True, name="max_micro_batch_size")
    if cap is not None and micro_batch_size != "auto":
        raise ValueError(
            '`max_micro_batch_size` must be None unless micro_batch_size="auto". '
            f"Received: max_micro_batch_size={cap!r}, "
            f"micro_batch_size={micro_batch_size!r}"
        )
    if micro_batch_size is not None and partial != "flush":
        raise ValueError(
            "`partial` must be 'flush' with `micro_batch_size`: each batch is one "
            "window, so no window is ever left partial at the end of the data. "
            f"Received: partial={partial!r}"
        )
    return micro_batch_size, cap


def check_batch_dimensions(first_dimensions, shapes) -> None:
    """The arrays of a batch to split into micro-batches agree on their first
    dimension (None: not known before the step runs)."""
    known = sorted({size for size in first_dimensions if size is not None})
    if len(known) > 1:
        shapes = ", ".join(str(tuple(shape)) for shape in shapes)
        raise ValueError(
            "The tensors of a batch must agree on their first (batch) dimension to "
            f"be split into micro-batches. Received: first dimensions {known} "
            f"(shapes {shapes})"
        )


def split_batch_size(data) -> int:
    """The (static) number of samples in a batch to split into micro-batches (JAX
    and PyTorch): the first dimension its arrays agree on."""
    leaves = [t for t in keras.tree.flatten(data) if t is not None]
    if not leaves or any(len(t.shape) == 0 for t in leaves):
        raise ValueError(
            "A batch to split into micro-batches must hold arrays with a batch "
            f"dimension. Received: arrays of shapes {[tuple(t.shape) for t in leaves]}"
        )
    check_batch_dimensions([t.shape[0] for t in leaves], [t.shape for t in leaves])
    return int(leaves[0].shape[0])


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    """Returns `value` if it is one of `choices`, else raises ValueError."""
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(
            f"`{name}` must be one of {allowed}. Received: {name}={value!r}"
        )
    return value


WEIGHTINGS = ("exact", "uniform")
NONFINITE = ("skip", "raise", "apply")


def check_weighting(weighting):
    """Returns `weighting` if it is a known name or a callable, else raises."""
    if callable(weighting) or (isinstance(weighting, str) and weighting in WEIGHTINGS):
        return weighting
    raise ValueError(
        "`weighting` must be one of 'exact', 'uniform' or a callable "
        f"(x, y, sample_weight) -> weight. Received: weighting={weighting!r}"
    )


def check_nonfinite(nonfinite):
    """Returns `nonfinite` if it is one of the names or a callable, else raises."""
    if callable(nonfinite) or (isinstance(nonfinite, str) and nonfinite in NONFINITE):
        return nonfinite
    raise ValueError(
        "`nonfinite` must be one of 'skip', 'raise', 'apply' or a callable "
        f"gradients -> bool (True skips the micro-batch). Received: nonfinite={nonfinite!r}"
    )


def check_weight_value(weight) -> None:
    """Checks a concrete (eager) micro-batch weight: finite and >= 0."""
    value = np.asarray(weight)
    if value.size != 1:
        raise ValueError(
            "`weight` must be a scalar. "
            f"Received: weight with shape {tuple(value.shape)}"
        )
    number = float(value.reshape(()))
    if not math.isfinite(number) or number < 0:
        raise ValueError(
            f"`weight` must be a finite number >= 0. Received: weight={number!r}"
        )


ACCUMULATOR_DTYPES = ("float16", "bfloat16", "float32", "float64")


def accumulator_dtype_name(accumulator_dtype) -> str:
    """The accumulator dtype's name (a string, a NumPy, TensorFlow or JAX dtype), or
    the fixed-form ValueError."""
    try:
        name = keras.backend.standardize_dtype(accumulator_dtype)
    except (TypeError, ValueError, AttributeError):
        name = None
    if name not in ACCUMULATOR_DTYPES:
        allowed = ", ".join(repr(d) for d in ACCUMULATOR_DTYPES)
        raise ValueError(
            f"`accumulator_dtype` must be a floating dtype, one of {allowed}. "
            f"Received: accumulator_dtype={accumulator_dtype!r}"
        )
    return name


def check_optimizer(optimizer) -> None:
    """Refuses what is not a Keras optimizer, or one that would accumulate gradients
    a second time."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "`optimizer` must be a keras.optimizers.Optimizer. "
            f"Received: optimizer of type {type(optimizer).__name__}"
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "The optimizer must not accumulate gradients itself when gradaccum "
            "does. Received: gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}. Create the optimizer "
            "without `gradient_accumulation_steps`."
        )


def check_loss_scale_optimizer(value) -> None:
    """Refuses what `accumulate(..., loss_scale_optimizer=...)` takes that is not a
    `keras.optimizers.LossScaleOptimizer`."""
    if not isinstance(value, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`loss_scale_optimizer` must be a keras.optimizers.LossScaleOptimizer. "
            f"Received: loss_scale_optimizer of type {type(value).__name__}"
        )


def check_variables(variables) -> list:
    """Returns `variables` as a non-empty list of variables, or raises."""
    try:
        listed = None if isinstance(variables, (str, bytes)) else list(variables)
    except TypeError:
        listed = None
    if not listed:
        raise ValueError(
            "`variables` must be a non-empty list of variables. "
            f"Received: variables={variables!r}"
        )
    for v in listed:
        if not all(hasattr(v, attr) for attr in ("shape", "dtype", "assign")):
            raise ValueError(
                "`variables` must be a non-empty list of variables. "
                f"Received: an element of type {type(v).__name__}: {v!r}"
            )
    return listed


def variable_name(variable) -> str:
    """A variable's path (or name), usable in a variable name."""
    import re

    name = getattr(variable, "path", None) or variable.name
    name = name.split(":")[0]
    return re.sub(r"[^A-Za-z0-9_./-]", "_", name)


def check_callable_result(value, option: str, *, kind: str, scalar: str, accepts):
    """A user callable's result (`nonfinite`, `weighting`, a `steps` schedule) as a
    scalar tensor of the current backend, or the fixed-form ValueError:
    `accepts(dtype_name)` says whether its dtype is `kind`."""
    value = keras.ops.convert_to_tensor(value)
    dtype = keras.backend.standardize_dtype(value.dtype)
    if not accepts(dtype):
        raise ValueError(
            f"The `{option}` callable must return {kind}. "
            f"Received: a value of dtype {dtype}"
        )
    shape = value.shape
    known = getattr(shape, "rank", 0) is not None
    if known and None not in tuple(shape) and int(np.prod(tuple(shape))) != 1:
        raise ValueError(
            f"The `{option}` callable must return {scalar}. "
            f"Received: a value of shape {tuple(shape)}"
        )
    return keras.ops.reshape(value, ())


def is_integer_dtype(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def is_number_dtype(dtype: str) -> bool:
    return is_integer_dtype(dtype) or dtype.startswith(("float", "bfloat"))


def callable_weight(fn, x, y, sample_weight):
    """Calls a user weighting function and checks that it gives a scalar number
    (float32); the backend's step checks at run time that it is >= 0."""
    weight = check_callable_result(
        fn(x, y, sample_weight),
        "weighting",
        kind="a number",
        scalar="a scalar weight",
        accepts=is_number_dtype,
    )
    return keras.ops.cast(weight, "float32")


# The message of a negative weight from a `weighting` callable.
NEGATIVE_WEIGHT = "The `weighting` callable must return a weight >= 0"


def check_noise_scale(noise_scale, reduction: str, privacy=None) -> bool:
    """`noise_scale` as a bool, refused where no estimate is right: a reduction
    other than "mean" (the estimators read the sums as weighted means), and
    differentially private training (a reading of the unnoised gradients would
    leak what the noise hides)."""
    noise_scale = check_flag("noise_scale", noise_scale)
    if noise_scale and reduction != "mean":
        raise ValueError(
            '`noise_scale=True` needs reduction="mean": the estimate reads the window\'s '
            "sums as a weighted mean of its micro-batches' gradients. Received: "
            f"reduction={reduction!r}")
    if noise_scale and privacy is not None:
        raise ValueError(
            "`noise_scale=True` cannot be used with `privacy`: the estimate reads the "
            "gradients before their noise, and logging it would reveal what the "
            "noise hides. Received: noise_scale=True with a gradaccum.Privacy")
    return noise_scale


def check_flag(name: str, value) -> bool:
    """`value` as a bool; raises unless it is True or False."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return bool(value)
