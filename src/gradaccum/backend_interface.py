"""What a backend writes, declared in one place.

A backend of gradaccum (`gradaccum/backends/<name>/`) writes two things, both
declared here and nothing else:

- a **window record** (`Record`): the state of a window as the state machine
  (`gradaccum.core.transitions`) reads and writes it, by field name, and the few
  primitives that differ per backend: where the sums live and how a gradient is
  added to them, conditional execution, the optimizer update, the non-finite
  check, what an error does;
- an **adapter** (`Adapter`): what `accumulate`, `wrap`, `audit` and
  `privacy_spent` need from a backend's accumulation that only the backend can do:
  its state, its training step, the end of the data, and a few hooks around
  Keras's `fit` (each with its default here: nothing).

Everything a backend gets for free is `gradaccum.adapter.Accumulation`, the
subclass of `Adapter` each backend's adapter subclasses in turn (it may also wrap
its `fitting` and `evaluating` contexts). `docs/adapters.md` walks through a new
backend.
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import keras

from gradaccum.core import noise_scale

if TYPE_CHECKING:  # pragma: no cover
    from gradaccum.core.options import Options
    from gradaccum.core.transitions import Outcome
    from gradaccum.core.window import ScheduleRunner

ops = keras.ops


class Record:
    """One record of the state as the transitions see it: fields by name, and the
    backend's primitives. This base keeps the fields in a dict (a functional
    backend's values, or a test's); a backend overrides what lives elsewhere.

    Args:
        values: the fields' current values by name.
    """

    # What the last micro-batch did to the window (`micro_batch` sets it).
    outcome: Outcome | None

    def __init__(self, values=None):
        self.values = dict(values or {})

    # Fields -------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.values

    def get(self, name: str):
        return self.values[name]

    def set(self, name: str, value) -> None:
        self.values[name] = ops.cast(value, self.values[name].dtype)

    def add(self, name: str, delta) -> None:
        value = self.get(name)
        self.set(name, value + ops.cast(delta, value.dtype))

    # Primitives ---------------------------------------------------------------------

    def sums(self) -> list:
        """The window's sums, one per variable."""
        raise NotImplementedError

    def dtypes(self) -> list:
        """The variables' dtypes (the combined gradient's)."""
        raise NotImplementedError

    def add_sums(self, gradients, factor, accept) -> None:
        """`sum += factor * g` per variable (`factor` None: `sum += g`) where
        `accept`; a `None` gradient leaves its sum."""
        raise NotImplementedError

    def close(self, apply, close, update, finish, empty_sums=True):
        """When `close` (a boolean tensor, or the Python True): `update()` when
        `apply` and the window holds an accepted micro-batch (`holds`), then
        `finish(applied)` (the bookkeeping, told whether the update ran), then the
        sums emptied (unless `empty_sums` is False). Returns whether the update ran
        (a boolean tensor)."""
        raise NotImplementedError

    def empty_sums(self) -> None:
        """Zeroes the window's sums."""
        raise NotImplementedError

    def set_sums(self, values) -> None:
        """Sets the sums whose entry in `values` is not None (the window's kept
        values of `overwrite_with_gradient` variables)."""
        raise NotImplementedError

    def window_weight(self):
        """The open window's total weight, the global window's under several
        replicas (a budget decides alike everywhere)."""
        return self.get("total_weight")

    def holds(self):
        """Whether the open window holds an accepted micro-batch (something to
        apply)."""
        return self.get("micro_step") > 0

    def apply(self, gradients) -> None:
        """One optimizer update with `gradients` (one per variable)."""
        raise NotImplementedError

    def all_finite(self, gradients):
        """Whether every element of every gradient is finite (a boolean tensor)."""
        raise NotImplementedError

    def squared_norm(self, gradients):
        """The squared norm of all of `gradients` together (the noise scale's
        piece, `core.noise_scale`), a float32 scalar: the one the screen computed
        for these gradients (`screened`) where it did, else `norm_of`'s."""
        screened = getattr(self, "_screened", None)
        if screened is not None and len(screened[0]) == len(gradients) and all(
                a is b for a, b in zip(screened[0], gradients)):
            return screened[1]
        return self.norm_of(gradients)

    def norm_of(self, gradients):
        """The backend's squared norm of `gradients` together (float32)."""
        return noise_scale.squared_norm(gradients)

    def screened(self, gradients, squared) -> None:
        """The screen (`all_finite`) computed `squared`, the squared norm of
        `gradients`: `squared_norm` takes it from here (one pass for both)."""
        self._screened = (list(gradients), squared)

    def fail(self, error, code: str, at, value=None) -> None:
        """`error` (a boolean tensor) says a micro-batch broke a rule (`ERRORS`'s
        `code`) at `at`: raise, or record it for `fit` to raise."""
        raise NotImplementedError

    def cond(self, pred, true_fn, false_fn):
        """`true_fn()` if `pred` else `false_fn()` (each returns a tensor of one
        shape and dtype), only the one taken run: conditional execution."""
        return true_fn() if bool(pred) else false_fn()

    def checked(self, value):
        """`value` once the record's errors so far are checked (where `fail` adds
        an assertion, a value that waits for it)."""
        return value

    def healthy(self):
        """Where errors are recorded rather than raised: whether none was (a boolean
        tensor); None where an error raises."""
        return None

    def noised(self, sums) -> list:
        """With `gradaccum.Privacy`, the window's sums with the noise of its update."""
        return sums

    def loss_scale(self):
        """Under a LossScaleOptimizer: its `(step_counter, dynamic_scale)` values;
        None without one."""
        return None

    def set_loss_scale(self, counter, scale) -> None:
        raise NotImplementedError

    # What the record holds of the accumulation's settings ----------------------------

    #: Whether a skipped micro-batch is counted in `skipped` as it is screened (False
    #: under several tf.distribute replicas: the update counts every replica's).
    counts_skips = True
    #: Whether the loss scale reacts per micro-batch (False under several replicas:
    #: once per window, at the update).
    reacts_now = True
    #: Whether each variable is `overwrite_with_gradient` (`gradaccum.core.overwrite`),
    #: in the sums' order; empty where none is.
    overwrites: tuple[bool, ...] = ()
    #: Whether each variable's newest entry measures the gradient (a float8 layer's
    #: output-gradient amax history: `overwrite.measured`); empty where none does.
    measured: tuple[bool, ...] = ()


class Findings(NamedTuple):
    """What an accumulation saw in the steps it ran that makes it differ from
    training on the window as one batch (`gradaccum.audit` names each).

    - `repeated`: `(optimizer name, calls per batch)` for an optimizer the step
      applies several times per batch to variables those calls share.
    - `stale`: `(later, earlier)` optimizer names where the step computes the
      gradients it hands to `later` after applying `earlier`, from variables
      `earlier` updates (read from the traced step where `stale_known`).
    - `stale_known`: whether the backend can tell `stale` (else a step with several
      `optimizers` may be).
    - `optimizers`: the names of the optimizers the step hands gradients to.
    - `inexact`: loss terms whose normalizers' ratios changed within a window.
    - `skipped`: micro-batches skipped for a non-finite gradient.
    """

    repeated: list
    stale: list
    stale_known: bool
    optimizers: list
    inexact: bool
    skipped: int

    def step_causes(self) -> list:
        """`(key, text)` for each thing the model's own step does that accumulation
        cannot reproduce exactly: `audit` names them, `fit` warns once each."""
        causes = []
        for name, count in self.repeated:
            causes.append(("repeated", (
                f"The model's train_step applies `self.{name}` {count} times per batch: "
                "accumulation makes those updates from gradients taken at the weights "
                "the window started from, where the large batch's step takes each after "
                "the previous update.")))
        for later, earlier in self.stale:
            causes.append(("stale", (
                f"The model's train_step computes the gradients it hands to "
                f"`self.{later}` after applying `self.{earlier}`, from variables "
                f"`self.{earlier}` updates (a GAN in keras.io's DCGAN order): on the large "
                "batch they see that update; accumulated, they are taken at the weights "
                "the window started from.")))
        if len(self.optimizers) > 1 and not self.stale_known:
            names = ", ".join(f"`self.{name}`" for name in self.optimizers)
            causes.append(("optimizers", (
                f"The model's train_step applies {len(self.optimizers)} optimizers per "
                f"batch ({names}): where a later call's gradients depend on variables an "
                "earlier call updates (a GAN's generator through its discriminator), the "
                "large batch takes them after that update and accumulation at the "
                "weights the window started from. On JAX and PyTorch gradaccum cannot "
                "tell whether they do.")))
        return causes


class Adapter(abc.ABC):
    """What a backend's accumulation writes: the abstract methods, and the hooks a
    backend may override (each does nothing here). `gradaccum.adapter.Accumulation`
    subclasses it with everything the backends share.
    """

    #: How messages name the backend ("TensorFlow", "JAX", "PyTorch").
    backend_name: ClassVar[str] = ""
    #: How the backend's step runs a `steps` callable (its `record.Runner`).
    runner: ClassVar[ScheduleRunner]
    #: Whether Keras's trainer on the backend runs several batches per compiled call
    #: (`steps_per_execution` > 1; not Keras's torch trainer).
    runs_several_steps: ClassVar[bool] = True

    @classmethod
    def check_options(cls, options: Options) -> None:
        """Refuses options the backend cannot honour (nothing by default)."""
        return None

    @classmethod
    def check_model(cls, model) -> None:
        """Checks a built model where `accumulate` or `wrap` receives it (nothing by default)."""
        return None

    #: Whether split mode runs a model's own `train_step` (TensorFlow); elsewhere the
    #: step's batch is its micro-batch, and split mode runs Keras's default step.
    splits_own_step = True

    # The state ------------------------------------------------------------------------

    @abc.abstractmethod
    def ensure_state(self) -> None:
        """Makes the state (before the train function is made), with any values
        waiting for it."""

    @abc.abstractmethod
    def drop_state(self) -> None:
        """Drops the state (a new compile: the next training makes it again)."""

    @abc.abstractmethod
    def fit_field(self, name: str):
        """A field of the fit record as a variable (`numpy()`, `assign`)."""

    @abc.abstractmethod
    def saved_variables(self) -> dict:
        """Every variable of the state a save keeps, under its stable name
        (`numpy()`, `assign`, `shape`)."""

    @abc.abstractmethod
    def windows(self) -> list:
        """Each window's accumulated variables and the prefix of its names:
        `(prefix, variables, vectors)` (`vectors`: names holding one entry per
        variable)."""

    @abc.abstractmethod
    def window_values(self, name: str) -> list:
        """A window record's field `name` in each window (Python ints)."""

    @abc.abstractmethod
    def detach(self) -> None:
        """`disable`: nothing of the state stays in the host."""

    # Training -------------------------------------------------------------------------

    @abc.abstractmethod
    def make_train_function(self, make, force=False):
        """The host's train function, made with Keras's `make` (its own
        `make_train_function`) after the state."""

    @abc.abstractmethod
    def train_step(self, *args):
        """The host's `train_step`: `(data)` on TensorFlow, `(state, data)` on JAX."""

    @abc.abstractmethod
    def end_of_data(self) -> None:
        """The data ended: the open windows are flushed or dropped as `partial`
        says (kept with `"carry"`); idempotent."""

    # Logs, the audit and privacy -----------------------------------------------------

    def logged_prefix(self) -> str:
        """The prefix, in `saved_variables`, of the window record whose counters
        the logs report (the updating optimizer's; "" for Keras's default step)."""
        return ""

    @abc.abstractmethod
    def last_window(self) -> tuple:
        """`(iterations, micro_batches, weight)` of the window the logs report: the
        update count of the optimizer `updates` counts (the model's, or the first
        its own step hands gradients to), what its last update's window held."""

    @abc.abstractmethod
    def window_gradients(self) -> list:
        """The open windows' combined gradient: `(variable, value or None)` per
        variable of each window (`gradaccum.audit`)."""

    @abc.abstractmethod
    def findings(self) -> Findings:
        """What the accumulation saw (`Findings`)."""

    @abc.abstractmethod
    def privacy_record(self) -> tuple[int, float]:
        """With privacy: the updates made and the most examples a window held."""

    # Hooks: what a backend adds around Keras's fit (nothing by default) ---------------

    def replicas(self) -> int:
        """Replicas the host trains on (a tf.distribute strategy's)."""
        return 1

    def building(self):
        """The context a `fit` or `train_on_batch` runs in for Keras's trainer to
        build an unbuilt model from its first batch before the train function is
        made (the state needs the variables then): what the JAX and PyTorch trainers
        always do; TensorFlow's defers the build into its traced step."""
        return contextlib.nullcontext()

    def after_train_on_batch(self, logs):
        """`train_on_batch`'s logs, after the step's errors are raised."""
        return logs

    def fit_failed(self) -> None:
        """`fit` raised: what the backend drops with it."""
        return None

    def batch_end_async_safe(self) -> bool:
        """Whether the hook's batch end may run in Keras's worker thread, while the
        next calls are dispatched (unless the backend must act on a call's result
        before the next runs)."""
        return True

    def before_batch(self, hook) -> None:
        """Before each compiled call of `fit`, in the fit's thread (the hook's
        `on_train_batch_begin`)."""
        return None

    def epoch_began(self, hook, resume_skip: int) -> None:
        """An epoch begins, its fields set (`resume_skip`: the micro-batches a
        restored run skips first): where a backend counts the window on the host,
        it starts from the state here."""
        return None

    def after_batch(self, hook, logs, deferred: bool = False) -> None:
        """After each compiled call of `fit` (the hook's `on_train_batch_end`), and
        with the epoch's logs at its end. `deferred`: in Keras's worker thread,
        where nothing may touch the model (the fit's thread goes on)."""
        return None

    def synced(self, hook) -> None:
        """Before the hook reads the state (JAX syncs the trainer's into it)."""
        return None

    def repeat_warning(self) -> str | None:
        """What fit warns about once per fit when the model's step applies an
        optimizer several times per batch (None: it does not)."""
        return None
