"""The accumulation state: its fields, declared once for every backend.

Two records hold everything gradaccum keeps between micro-batches:

- a **window record** per accumulator (an optimizer's share of the model's
  variables: Keras's default step has one, a GAN's own step one per optimizer): the
  open window's sums and counters and the running totals of its updates;
- a **fit record** per model that `fit` trains: the epoch's position, resuming
  inside it, the loss terms' normalizer ratios, the privacy accountant's largest
  window, and the errors a compiled step records for `fit` to raise after it.

A backend decides where the fields live (TensorFlow variables, arrays riding in
JAX's trainer state) and which of the optional ones it keeps; the names here are
the names checkpoints keep, and `gradaccum.core.transitions` reads and writes the
fields by them. The per-variable sums are named `accumulator_<i>`.
"""

from __future__ import annotations

from typing import NamedTuple


class Field(NamedTuple):
    """One field of a record.

    - `name`: its name in the state and in checkpoints.
    - `kind`: `"count"` (an integer: int64 on TensorFlow, int32 on JAX), `"weight"`
      (the weights' float: float64 with float64 accumulators, else float32),
      `"flag"` (a boolean), `"ratios"` (float32, one per loss term beyond the first),
      `"per_variable"` (the weights' float, one per accumulated variable).
    - `initial`: its value in a new record.
    - `reset`: whether closing a window zeroes it.
    - `doc`: what it holds.
    """

    name: str
    kind: str
    initial: float = 0
    reset: bool = False
    doc: str = ""


WINDOW = (
    Field("total_weight", "weight", reset=True,
          doc="the sum of the open window's accepted micro-batch weights"),
    Field("micro_step", "count", reset=True,
          doc="micro-batches accumulated in the open window"),
    Field("window_skipped", "count", reset=True,
          doc="micro-batches of the open window skipped as not finite (they count "
              "towards its length)"),
    Field("received", "per_variable", reset=True,
          doc="per variable, the open window's micro-batches that gave it a gradient: "
              "a variable with none is left out of the update (kept where a gradient "
              "can be missing at run time: TensorFlow)"),
    Field("window_steps", "count",
          doc="the open window's length under a `steps` schedule, read from it when "
              "the window opened"),
    Field("skipped", "count", doc="micro-batches skipped in all"),
    Field("micro_batches", "count",
          doc="micro-batches presented since the record was made, skipped ones included"),
    Field("updates", "count", doc="windows applied: the position of a `steps` schedule"),
    Field("last_window_micro_batches", "count",
          doc="micro-batches the last update's window held, skipped ones included"),
    Field("last_window_weight", "weight",
          doc="the total weight of the last update's window (across replicas)"),
)

FIT = (
    Field("epoch_step", "count", doc="micro-batches (batches in split mode) seen in the "
          "current epoch"),
    Field("epoch_length", "count", initial=-1,
          doc="the epoch's length in micro-batches (-1: unknown), for the window the "
              "data ends in"),
    Field("resume_skip", "count",
          doc="micro-batches still to skip after a restore inside an epoch"),
    Field("term_ratios", "ratios",
          doc="with several loss terms, their normalizers' ratios to the first at the "
              "window's start"),
    Field("inexact", "flag",
          doc="whether a window's loss terms had other ratios (one weight per "
              "micro-batch is then not exact)"),
    Field("unequal", "flag",
          doc="with float8 layers: whether a window's micro-batches weighed "
              "differently (float8 then quantized a micro-batch's gradient at "
              "another size than the large batch's)"),
    Field("outside_fit", "flag",
          doc="whether `train_on_batch` calls left the open window: the next `fit` "
              "closes it as `partial` says before its first batch (saved with the "
              "window, so a restored one is closed alike)"),
    Field("largest_window", "weight",
          doc="with `gradaccum.Privacy`: the most examples a window applied held (the "
              "accountant's sampling rate)"),
    Field("error", "count",
          doc="the first run-time error of a compiled step that cannot raise (`ERRORS`)"),
    Field("error_at", "count",
          doc="where that error happened: the micro-batch's place in its window "
              "(counted from 1), or the update index for a schedule's value below 1"),
    Field("error_micro_batch", "count",
          doc="that micro-batch's number among all micro-batches (from 1)"),
)

# With `noise_scale=True`, each window record also keeps these
# (`gradaccum.core.noise_scale`): the open window's pieces, and the estimates of the
# windows closed since the last reading (an epoch's start in `fit`).
NOISE = (
    Field("noise_pieces_norm", "weight", reset=True,
          doc="the open window's sum over its pieces (its accepted micro-batches, or "
              "their replicas' shares) of |w_p g_p|^2 / w_p"),
    Field("noise_spread", "weight", reset=True,
          doc="its pieces' sum of w_p / n_p (n_p: a piece's samples)"),
    Field("noise_spread_squared", "weight", reset=True,
          doc="its pieces' sum of w_p^2 / n_p"),
    Field("noise_pieces", "weight", reset=True,
          doc="the open window's pieces of nonzero weight"),
    Field("noise_pieces_weight", "weight", reset=True,
          doc="their total weight (the window's, unless its first micro-batches came "
              "before the noise scale was kept)"),
    Field("noise_trace", "weight",
          doc="the sum, over the windows closed since the last reading, of their "
              "estimate of tr(Sigma) in samples"),
    Field("noise_gradient", "weight",
          doc="the same windows' sum of their estimate of |G|^2"),
    Field("noise_windows", "count", doc="the windows those sums hold"),
    Field("noise_steps", "count",
          doc="with a `NoiseScaleSchedule`: the window length it has set"),
)

# The open window's noise fields: under several replicas or processes, each one's
# own pieces, summed when the window closes.
NOISE_PIECES = tuple(field.name for field in NOISE if field.reset)

WINDOW_NAMES = tuple(field.name for field in WINDOW)
FIT_NAMES = tuple(field.name for field in FIT)
# Fields the window's close zeroes.
RESET = tuple(field.name for field in WINDOW + NOISE if field.reset)
# Fields that describe the running epoch, never restored from a checkpoint into
# another fit (its hook sets them).
EPOCH_ONLY = ("epoch_length",)
# The errors a compiled step records in `error` (0: none).
# "miscount": a step compiled without the close met a window that was due (the
# host's count of the window, `core/host_window.py`, disagreed with the state).
ERRORS = {"nonfinite": 1, "negative_weight": 2, "schedule": 3, "miscount": 4}
# The fields of an error (kept when a split batch's error undoes the rest).
ERROR_FIELDS = ("error", "error_at", "error_micro_batch")


# Non-trainable variables larger than this are taken as frozen weights (a LoRA base
# model's kernels): a training step reads them and never changes them, so they are
# not copied before a micro-batch to be put back if it is skipped or fails.
LARGEST_KEPT = 1 << 16


def fields(record, *, without=(), noise: bool = False) -> tuple:
    """The fields of `record` (`WINDOW` or `FIT`) but those named in `without`;
    with `noise`, the window record's `NOISE` fields after them."""
    return tuple(field for field in record if field.name not in without) + (
        NOISE if noise else ())


def accumulator_name(index: int) -> str:
    """The name of the window's sum of variable `index`."""
    return f"accumulator_{index}"
