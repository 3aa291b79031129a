"""The gradient noise scale, estimated from each window's own micro-batches.

How large should a batch be? McCandlish, Kaplan, Amodei et al. (2018, "An
Empirical Model of Large-Batch Training") answer with the gradient noise scale

    B_simple = tr(Sigma) / |G|^2

(`G` the true gradient, `Sigma` the per-sample gradients' covariance): batches much
smaller than B_simple waste optimizer steps on noise, batches much larger waste
samples. Their Appendix A.1 estimates both terms from gradient norms at two batch
sizes. A window has those two sizes for free: its micro-batches and the window.

A window of pieces `p` (its accepted micro-batches; under several replicas or
devices, each one's share of them), each of `n_p` samples, weight `w_p` (its loss
normalizer: samples, tokens; 1 under `weighting="uniform"`) and mean gradient `g_p`,
combines into `G_W = sum_p w_p g_p / W` with `W = sum_p w_p`. For independent
samples `E|g_p|^2 = |G|^2 + S / n_p` (`S = tr(Sigma)`, per sample), so with
`x = sum_p w_p |g_p|^2 / W`, `a = sum_p w_p / n_p / W` and `c = sum_p w_p^2 / n_p /
W^2`:

    E x = |G|^2 + a S,    E|G_W|^2 = |G|^2 + c S

and the unbiased estimators are

    S     ~ (x - |G_W|^2) / (a - c)
    |G|^2 ~ (a |G_W|^2 - c x) / (a - c)

(with `w_p = n_p`, the paper's two batch sizes `W / m` and `W` for `m` pieces).
A window needs two pieces of weight or more (then `a > c`). `S` is per sample, so
the noise scale is in samples, the unit of a batch size; where the weights are
tokens, tokens of one sequence count as one sample (they are not independent). A
reading is the ratio of the windows' sums of the two estimates (the ratio of their
averages, the paper's practice: a ratio per window is noisy and biased).

The step adds each piece's `|w_p g_p|^2 / w_p` (`add_piece`: one squared norm per
micro-batch) and, at the close, one squared norm of the sums (`window_closed`). All
of it stays on the device; a reading is taken by the host after an epoch or a
window (`estimate`).
"""

from __future__ import annotations

import math

import keras
import numpy as np

from gradaccum.core import overwrite

ops = keras.ops

# The largest k a `NoiseScaleSchedule` sets without a `max_steps` (an estimate of
# |G|^2 near 0 reads as a noise scale without bound).
LARGEST_STEPS = 1 << 20

# The record's fields for the open window's pieces (`add_piece`), in the order
# `window_estimates` takes them.
PIECES = ("noise_pieces_norm", "noise_spread", "noise_spread_squared", "noise_pieces",
          "noise_pieces_weight")

# The record's fields for the readings' sums (`core.state.NOISE`), and with a
# `NoiseScaleSchedule` the window length it set.
TOTALS = ("noise_trace", "noise_gradient", "noise_windows")
FIELDS = (*TOTALS, "noise_steps")


def squared_norm(gradients):
    """The squared norm of all of `gradients` together (None entries left out), a
    float32 scalar."""
    total = ops.zeros((), "float32")
    for g in gradients:
        if g is not None:
            g = ops.cast(g, "float32")
            total = total + ops.sum(g * g)
    return total


def piece_norm(record, gradients, factor):
    """`|factor * g|^2` over a micro-batch's gradients (not an
    `overwrite_with_gradient` variable's value): the squared norm of what the sums
    take (`factor` None: the gradients as they are). None without the record's
    noise fields."""
    if not record.has("noise_pieces_norm"):
        return None
    squared = record.squared_norm(overwrite.ordinary(gradients, record.overwrites))
    if factor is None:
        return squared
    factor = ops.cast(factor, "float32")
    return squared * factor * factor


def add_piece(record, gradients, factor, weight, accept, samples=None,
              pieces=None) -> None:
    """Counts a micro-batch as one piece of the open window: its `gradients` times
    `factor` (None: 1) are what the sums take of it, `w_p g_p`; `weight` its `w_p`,
    `samples` its `n_p` (None: its weight). An accepted piece of nonzero weight
    counts. Nothing without the record's noise fields.

    `pieces`: where the step cut the micro-batch itself (each device's share under
    a keras.distribution: `gradients` are then the devices' rows), the sums over its
    pieces `d` of nonzero weight of `(|g_d|^2 / w_d, w_d / n_d, w_d^2 / n_d, 1,
    w_d)`, in the gradients' scale (`factor` applies to the first squared)."""
    if not record.has("noise_pieces_norm"):
        return
    weight = ops.cast(weight, "float32")
    counted = ops.logical_and(accept, weight > 0)
    if pieces is None:
        safe = ops.where(counted, weight, 1.0)
        samples = safe if samples is None else ops.cast(samples, "float32")
        samples = ops.where(samples > 0, samples, 1.0)
        terms = [piece_norm(record, gradients, factor) / safe, safe / samples,
                 safe * safe / samples, 1.0, safe]
    else:
        factor = 1.0 if factor is None else ops.cast(factor, "float32")
        terms = [ops.cast(value, "float32") for value in pieces]
        terms[0] = terms[0] * factor * factor
    for name, term in zip(PIECES, terms):
        held = record.get(name)
        record.set(name, held + ops.cast(ops.where(counted, term, 0.0), held.dtype))


def window_estimates(pieces_norm, spread, spread_squared, pieces, pieces_weight,
                     sums_norm, weight):
    """One window's `(trace, gradient, counted)`: its estimates of tr(Sigma) (per
    sample) and of |G|^2, and whether it counts (two pieces of weight or more, and
    every micro-batch the sums hold among them). The sums over its pieces of
    `|w_p g_p|^2 / w_p` (`pieces_norm`), `w_p / n_p` (`spread`), `w_p^2 / n_p`
    (`spread_squared`), 1 (`pieces`) and `w_p` (`pieces_weight`); `sums_norm`:
    `|sum_p w_p g_p|^2`; `weight`: W.

    Example (two pieces of 4 samples; their gradients 1 and 3, so the window's is 2):

        >>> import numpy as np
        >>> trace, gradient, counted = window_estimates(
        ...     pieces_norm=(4 * 1) ** 2 / 4 + (4 * 3) ** 2 / 4, spread=2.0,
        ...     spread_squared=8.0, pieces=2, pieces_weight=8,
        ...     sums_norm=(4 * 1 + 4 * 3) ** 2, weight=8)
        >>> float(trace), float(gradient), bool(counted)
        (8.0, 3.0, True)
    """
    weight = ops.cast(weight, "float32")
    pieces_weight = ops.cast(pieces_weight, "float32")
    safe = ops.where(weight > 0, weight, 1.0)
    small = ops.cast(pieces_norm, "float32") / safe                    # x
    large = ops.cast(sums_norm, "float32") / (safe * safe)            # |G_W|^2
    a = ops.cast(spread, "float32") / safe
    c = ops.cast(spread_squared, "float32") / (safe * safe)
    # (A window whose first micro-batches were added before the noise scale was
    # kept, a restored one, holds more weight than its pieces: it does not count.)
    counted = ((ops.cast(pieces, "float32") >= 2) & (weight > 0) & (a > c * (1 + 1e-6))
               & (ops.abs(pieces_weight - weight) <= 1e-5 * weight))
    spare = ops.where(counted, a - c, 1.0)
    trace = (small - large) / spare
    gradient = (a * large - c * small) / spare
    return (ops.where(counted, trace, 0.0), ops.where(counted, gradient, 0.0), counted)


def window_closed(record, sums, weight) -> list:
    """At an applied window's close, inside the update: its estimates added to the
    readings' sums (`sums`: the window's summed gradients, `w_p g_p` summed over its
    pieces; `weight`: its total weight W, across replicas). Nothing without the
    record's noise fields. Returns `sums`."""
    if not record.has("noise_pieces_norm"):
        return sums
    held = [record.get(name) for name in PIECES]
    trace, gradient, counted = window_estimates(
        held[0], held[1], held[2], held[3], held[4],
        squared_norm(overwrite.ordinary(sums, record.overwrites)), weight)
    for name, value in (("noise_trace", trace), ("noise_gradient", gradient)):
        held = record.get(name)
        record.set(name, held + ops.cast(value, held.dtype))
    record.add("noise_windows", ops.cast(counted, "int32"))
    return sums


def estimate(trace, gradient, windows) -> float:
    """A reading: the noise scale B_simple in samples from the readings' sums (the
    ratio of the windows' averages), NaN where no window counted or the estimate of
    |G|^2 is not above 0 (the gradient is lost in its noise: more samples per
    window are needed to see it).

    Example:

        >>> estimate(trace=900.0, gradient=3.0, windows=3)
        300.0
        >>> estimate(trace=900.0, gradient=-1.0, windows=3)
        nan
    """
    trace, gradient = float(np.asarray(trace)), float(np.asarray(gradient))
    if int(np.asarray(windows)) < 1 or not gradient > 0:
        return math.nan
    return trace / gradient


@keras.saving.register_keras_serializable(package="gradaccum")
class NoiseScaleSchedule:
    """`steps` that follows the gradient noise scale: each window's length is
    `k = clip(round(B_simple / micro_batch_size), min_steps, max_steps)`, from the
    noise scale the windows measure (so `noise_scale=True` is implied).

    k changes only where a window's length may change (when a window opens): with
    `every="epoch"` (default) at an epoch's start, from the last epoch's estimate
    (`fit`'s logs show the epoch's `noise_scale` and the `steps` it trained with);
    with `every=N`, at every N-th update, from the estimate of the epoch's windows
    so far. Where there is no estimate yet (the first epoch; an estimate of |G|^2
    not above 0), k stays as it is. The learning rate is left as it is: see the
    guide "Choosing k" for what the paper says of it as the batch grows.

    Args:
        micro_batch_size: the samples in each micro-batch (`fit`'s `batch_size`).
        min_steps: the fewest micro-batches per window, >= 2 (a window of one
            micro-batch on one device measures nothing).
        max_steps: the most (None: `LARGEST_STEPS`, 2**20). Late in training the
            noise scale grows without bound as |G|^2 nears 0: a bound keeps
            several updates per epoch.
        initial_steps: k until the first estimate, from `min_steps` to
            `max_steps` (None: `min_steps`).
        every: `"epoch"`, or an integer N >= 1 of updates.

    Example (on any backend):

        >>> import gradaccum
        >>> schedule = gradaccum.NoiseScaleSchedule(micro_batch_size=32, max_steps=16)
        >>> schedule.steps_for(300.0), schedule.steps_for(2000.0), schedule.steps_for(10.0)
        (9, 16, 2)
    """

    def __init__(self, micro_batch_size: int, *, min_steps: int = 2,
                 max_steps: int | None = None, initial_steps: int | None = None,
                 every: int | str = "epoch") -> None:
        self.micro_batch_size = _integer("micro_batch_size", micro_batch_size, 1)
        self.min_steps = _integer("min_steps", min_steps, 2)
        self.max_steps = (None if max_steps is None
                          else _integer("max_steps", max_steps, self.min_steps))
        self.initial_steps = (self.min_steps if initial_steps is None
                              else _integer("initial_steps", initial_steps, self.min_steps))
        if self.max_steps is not None and self.initial_steps > self.max_steps:
            raise ValueError("`initial_steps` must be at most `max_steps`. Received: "
                             f"initial_steps={initial_steps!r}, max_steps={max_steps!r}")
        if not (every == "epoch" or (_is_int(every) and int(every) >= 1)):
            raise ValueError('`every` must be "epoch" or an integer >= 1 of updates. '
                             f"Received: every={every!r}")
        self.every = every if every == "epoch" else int(every)

    def steps_for(self, estimate: float) -> int | None:
        """The window length for a noise scale `estimate` in samples (None for NaN:
        no estimate)."""
        if not math.isfinite(estimate):
            return None
        return int(min(max(self.min_steps, round(estimate / self.micro_batch_size)),
                       self.largest))

    @property
    def largest(self) -> int:
        """The largest k: `max_steps`, else `LARGEST_STEPS`."""
        return LARGEST_STEPS if self.max_steps is None else self.max_steps

    def get_config(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "min_steps": self.min_steps,
                "max_steps": self.max_steps, "initial_steps": self.initial_steps,
                "every": self.every}

    @classmethod
    def from_config(cls, config: dict) -> NoiseScaleSchedule:
        return cls(**config)

    def __repr__(self) -> str:
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"NoiseScaleSchedule({arguments})"

    def __eq__(self, other) -> bool:
        return (isinstance(other, NoiseScaleSchedule)
                and other.get_config() == self.get_config())

    def __hash__(self) -> int:
        return hash(tuple(self.get_config().items()))


def accumulator_noise(noise_scale: bool, rule) -> bool:
    """Whether a `GradientAccumulator` keeps the noise scale: `noise_scale`, or a
    `NoiseScaleSchedule` as its `steps` (which needs it). A custom loop has no
    epochs: its schedule must set k every N updates."""
    schedule = rule.steps
    if not isinstance(schedule, NoiseScaleSchedule):
        return noise_scale
    if schedule.every == "epoch":
        raise ValueError(
            "A GradientAccumulator's NoiseScaleSchedule must set k every N updates: a "
            "custom loop has no epochs (or read `noise_scale` and make a new "
            "accumulator yourself). Received: every='epoch'; pass every=N.")
    return True


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _integer(name: str, value, least: int) -> int:
    if not _is_int(value) or int(value) < least:
        raise ValueError(f"`{name}` must be an integer >= {least}. "
                         f"Received: {name}={value!r}")
    return int(value)


def followed_length(schedule: NoiseScaleSchedule, record, opening):
    """The open window's length under a `NoiseScaleSchedule` (an int32 tensor):
    where the window is `opening`, the schedule's k (its `initial_steps` before any,
    set anew here at every `every`-th update from the windows' estimate so far),
    else the length the window opened with. Writes the schedule's k."""
    held = ops.cast(record.get("noise_steps"), "int32")
    held = ops.where(held < 1, schedule.initial_steps, held)
    if schedule.every != "epoch":
        updates = ops.cast(record.get("updates"), "int32")
        trace = ops.cast(record.get("noise_trace"), "float32")
        gradient = ops.cast(record.get("noise_gradient"), "float32")
        due = (opening & (updates > 0) & (updates % schedule.every == 0)
               & (record.get("noise_windows") > 0) & (gradient > 0))
        estimate = trace / ops.where(gradient > 0, gradient, 1.0)
        steps = ops.clip(ops.round(estimate / schedule.micro_batch_size),
                         schedule.min_steps, schedule.largest)
        held = ops.where(due, ops.cast(steps, "int32"), held)
    record.set("noise_steps", held)
    return ops.where(opening, held, ops.cast(record.get("window_steps"), "int32"))
