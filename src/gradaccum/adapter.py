"""The adapter interface: what `accumulate`, `wrap`, `audit` and `privacy_spent` call
on a backend's accumulation, declared once, and what every backend's accumulation
does alike.

`Accumulation` is the base class each backend's adapter subclasses
(`backends/<name>/fit.py`). Its public methods are everything the entry points use;
they hold what is the same on every backend: `fit` with gradaccum's epoch hook first
among the callbacks (`gradaccum.epochs`), the epoch's log entries, the warnings,
and saving the accumulation state beside the weights and restoring it (values wait
for a state made later, each window's sums keyed by their variable:
`gradaccum.saving`). A backend writes the abstract methods: where its state lives,
its training step, and what its window records hold. `docs/adapters.md` says what a
new backend writes.
"""

from __future__ import annotations

import warnings

import numpy as np

from gradaccum import _keras_common as kc
from gradaccum import epochs, saving
from gradaccum.backend_interface import Adapter
from gradaccum.core import fit_logs, messages, moving_statistics, overwrite
from gradaccum.core.auto_size import AutoSize
from gradaccum.core.moving_statistics import Follower
from gradaccum.core.options import Options
from gradaccum.core.privacy import check_fit as check_private_fit
from gradaccum.core.privacy import check_layers as check_private_layers
from gradaccum.core.privacy import spent
from gradaccum.core.screening import warn_skipped
from gradaccum.core.validation import check_optimizer
from gradaccum.exact_epochs import observing_epochs
from gradaccum.weighting import NormalizerLog

# The instance attribute that holds a model's accumulation (`accumulate` or `wrap`).
ATTRIBUTE = "_gradaccum_accumulation"


def accumulation_of(model):
    """The accumulation attached to `model` (by `accumulate` or `wrap`), or None."""
    return getattr(model, "__dict__", {}).get(ATTRIBUTE)


# The fewest loss terms the fit record has room for, once the model has a compiled loss.
TERM_SLOTS = 8


class Accumulation(Adapter):
    """Gradient accumulation attached to a model that `fit` trains (its host): the
    user's own model (`gradaccum.accumulate`) or `wrap`'s `AccumulatingModel`.

    Args:
        options: the checked options (`checked_options`).
        layers: the model trained (the host itself, or `wrap`'s inner model).
    """

    @classmethod
    def checked_options(cls, **values) -> Options:
        """The options `accumulate` or `wrap` was given (`core.options.OPTIONS` by
        name), checked, with the backend's runner and its own checks."""
        options = Options(runner=cls.runner, **values)
        cls.check_options(options)
        return options

    def __init__(self, options, layers):
        self.options = options
        # What the state machine follows (`gradaccum.core.transitions`).
        self.policy = options.policy()
        self.layers = layers
        self.host = None
        # The backend's state, None before it is made (the first training).
        self.state = None
        # The host's own `train_step` (bound; None: Keras's default step).
        self.own_train_step = None
        # What the compiled losses record their normalizers into (exact weighting).
        self.normalizers = NormalizerLog()
        # Whether the running fit can restore inside an epoch (BackupAndRestore).
        self.resumable = False
        # `accumulate`: the compile the user made, restored by `disable`.
        self.user_compile_config = None
        # Whether gradaccum chose the compile's `steps_per_execution` (the window).
        self.chose_steps_per_execution = False
        # micro_batch_size="auto": the search.
        self.auto_size = AutoSize(options.max_micro_batch_size) if options.auto else None
        # What `fit` was given (the "auto" search speaks when it is verbose).
        self.verbose = 0
        self.announced = None
        # Micro-batches skipped before the running fit began (its hook sets it).
        self.skipped_at_start = 0
        # Whether the model has float8 layers whose micro-batches gradaccum's step
        # divides by the window's expected weight (`check_overwrites`), and whether
        # a window of theirs was flushed short at the end of the data (`data_ends`).
        self.float8_divided = False
        self.short_end = False
        self._pending = {}
        self._warned = set()
        # Within a save that writes the window itself (gradaccum.model_file).
        self.saving_window = False
        # Keras's BatchNormalization layers followed through the window
        # (`core.moving_statistics`): found when the state is first made.
        self.follower = None
        self._follower_unbuilt = False

    def default_steps_per_execution(self) -> int:
        """Micro-batches a compiled call runs by default (`steps_per_execution`
        "window"): the window's length when it is constant, else 1 (schedules,
        budgets, split mode); 1 under several replicas, where Keras's multi-step
        train function fails (keras issue 19246), and where the trainer runs one
        batch per call."""
        if not self.runs_several_steps or self.replicas() > 1:
            return 1
        return self.options.window.constant or 1

    # Where accumulate and wrap receive a model ------------------------------------

    def attach(self, host, own_step=None) -> None:
        """Attaches to `host`; `own_step` is the host's own `train_step` (bound), or
        None for Keras's default step."""
        if own_step is not None and self.options.split and not self.splits_own_step:
            raise ValueError(
                f"On Keras's {self.backend_name} backend a model's own "
                "`train_step` accumulates with `steps` (each batch is a micro-batch); "
                "split mode runs Keras's default step. Received: "
                f"micro_batch_size={self.options.micro_batch_size!r} for model "
                f"{host.name!r} of class {type(host).__name__}, which defines its own "
                "`train_step`."
            )
        self.host = host
        self.own_train_step = own_step

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch size of split mode: the one given, or the one `"auto"`
        chose (None before its first batch, and in `steps` mode)."""
        if self.auto_size is not None:
            return self.auto_size.chosen
        return self.options.micro_batch_size

    def evaluating(self):
        """The context `evaluate` runs in: its `steps` (`validation_steps` in `fit`)
        count batches as at one batch per call, whatever `steps_per_execution`."""
        return observing_epochs(self.host)

    def before_evaluate(self, kwargs) -> None:
        if kwargs.get("_use_cached_eval_dataset"):
            # Validation inside fit sees the epoch's partial window applied.
            self.end_of_data()

    def before_predict(self, args, kwargs) -> None:
        """`predict(steps=n)`: Keras's predict runs whole calls of
        `steps_per_execution` batches (unlike `fit` and `evaluate`, whose epochs
        gradaccum makes exact), so where gradaccum chose that number (the window) and
        `n` is not a multiple of it, the predictions would hold more batches than
        asked for: refused, with the ways out."""
        steps = args[3] if len(args) > 3 else kwargs.get("steps")
        per_call = getattr(self.host, "steps_per_execution", 1) or 1
        if (steps is not None and self.chose_steps_per_execution and per_call > 1
                and int(steps) % per_call):
            raise ValueError(
                "`steps` of `predict` must be a multiple of the model's "
                f"`steps_per_execution` ({per_call}, the window gradaccum chose at "
                "compile: Keras predicts whole calls of that many batches). Received: "
                f"steps={steps}. Pass a multiple of {per_call}, leave `steps` out, or "
                "compile with `steps_per_execution=1`."
            )

    def check_optimizers(self) -> None:
        """As a `fit` or `train_on_batch` starts: no optimizer of the host
        accumulates gradients itself (`gradient_accumulation_steps` can be set on
        an optimizer after `compile`, which checked it)."""
        for _, optimizer in kc.named_optimizers(self.host):
            check_optimizer(optimizer)

    def train_on_batch(self, train_on_batch, args, kwargs):
        """Runs Keras's `train_on_batch` (the host's own): the batch is one
        micro-batch, and a window applies when its rule closes it (`steps` calls,
        a schedule, a weight budget). No call is the end of the data: the window
        left open is closed as `partial` says when the next `fit` starts, or by
        `gradaccum.end_of_data` (or `disable`)."""
        self.check_optimizers()
        epochs.warn_loop_schedule(self)
        with self.building():
            logs = train_on_batch(*args, **kwargs)
        if self.state is not None:
            self.fit_field("outside_fit").assign(True)
        return self.after_train_on_batch(logs)

    def close_outside_fit(self, always: bool = False) -> None:
        """The window `train_on_batch` calls left open is closed as `partial` says
        (kept with "carry"): the micro-batches given before a `fit` are data that
        ended. A window a `fit` left (interrupted, or carried) goes on, unless
        `always` (`gradaccum.end_of_data`). The flag is a field of the state, saved
        with the window."""
        if self.state is None:
            return
        flag = self.fit_field("outside_fit")
        if always or bool(flag.numpy()):
            self.end_of_data()
            flag.assign(False)

    # fit ------------------------------------------------------------------------------

    def fit(self, fit, x, y, batch_size, epochs_, verbose, callbacks, kwargs):
        """Runs `fit` (the host's own) with gradaccum's hook first among callbacks."""
        check_private_fit(self.options, x, batch_size)
        self.check_optimizers()
        self.close_outside_fit()
        x = epochs.warn_added_losses(self, x)
        epochs.warn_uniform(self, x, batch_size, kwargs)
        self.verbose = verbose
        self._warned.discard("repeated")
        hook = epochs.EpochHook(self)
        callbacks = epochs.begin_fit(self, hook, epochs_, callbacks, kwargs)
        try:
            with self.fitting(hook):
                history = fit(x, y, batch_size=batch_size, epochs=epochs_, verbose=verbose,
                              callbacks=callbacks, **kwargs)
        except BaseException:
            self.fit_failed()
            epochs.after_fit(self, failed=True)
            raise
        epochs.after_fit(self)
        return history

    def fitting(self, hook):
        """The context `fit` runs in: the hook told the epoch's length as Keras's
        epoch iterator counts it, whatever callbacks `fit` was given (a caller's
        `CallbackList` gets no `params["steps"]`); a backend adds its own (workers)."""
        return observing_epochs(self.host, hook)

    def epoch_length(self, hook) -> int | None:
        """Batches per epoch of the running fit (None: unknown)."""
        return hook.epoch_length or (hook.params or {}).get("steps") or None

    # The state ------------------------------------------------------------------------

    def follow(self) -> Follower:
        """The followed layers (`core.moving_statistics`), found in the built model
        the first time (a warning names each layer that cannot be followed), their
        moments observed from then on."""
        if self.follower is None or self._follower_unbuilt:
            follows = self.options.follows_moving_statistics
            # A subclassed model with its own step is built by its first step, after
            # the state is made: its layers cannot be followed in this fit (they are
            # found when a later state is made, the model built).
            unbuilt = follows and not self.layers.built
            if unbuilt and not self._follower_unbuilt:
                moving_statistics.warn_unbuilt(self.layers,
                                                kc.flatten_layers(self.layers))
            followed: list = []
            if follows and not unbuilt:
                followed, refused = moving_statistics.find(self.layers,
                                                           kc.flatten_layers(self.layers))
                if followed and self.replicas() > 1:
                    # Each replica moves its layers from its own share: the global
                    # window's statistics need gradaccum.BatchNormalization there.
                    moving_statistics.warn_replicas(followed, self.replicas())
                    followed = []
                moving_statistics.warn_unfollowed(refused)
            self.follower, self._follower_unbuilt = Follower(followed), unbuilt
        self.follower.install()
        return self.follower

    def release(self) -> None:
        """`disable`: the layers' observers removed, then the backend's `detach`."""
        if self.follower is not None:
            self.follower.uninstall()
        self.detach()

    def check_trainable(self) -> int:
        """Before the state is made: the model trained is built, has trainable
        variables, and (with privacy) an optimizer without loss scaling. Returns how
        many loss terms beyond the first the fit record tracks the normalizer
        ratios of (at least `TERM_SLOTS - 1` once there is a compiled loss)."""
        host, layers = self.host, self.layers
        if not layers.built:
            raise ValueError(
                "The model being trained must be built before its accumulation state is "
                f"created. Received: model {layers.name!r} that is not built (fit builds "
                "it from its first batch: is the data empty?). Give the model an Input, "
                "or call it on a batch first."
            )
        if not host.trainable_variables:
            raise ValueError(
                "The model being trained must have trainable variables to accumulate "
                f"gradients of. Received: model {layers.name!r} with none."
            )
        self.check_overwrites()
        if self.options.privacy is not None:
            check_private_layers(layers, kc.flatten_layers(layers))
            if kc.is_loss_scale_optimizer(host.optimizer):
                raise ValueError(
                    "`privacy` needs an optimizer without loss scaling: each example's "
                    "gradient is clipped before the sum. Received: a LossScaleOptimizer "
                    "(the mixed_float16 policy); use mixed_bfloat16 or float32."
                )
            factor = getattr(host.optimizer, "loss_scale_factor", None)
            if factor is not None:
                raise ValueError(
                    "`privacy` needs an optimizer without loss scaling: each example's "
                    "gradient is clipped and noised unscaled, and the optimizer's "
                    "`loss_scale_factor` would divide the update by the factor. "
                    f"Received: loss_scale_factor={factor!r}. Create the optimizer "
                    "with loss_scale_factor=None."
                )
        terms = kc.count_compiled_losses(kc.compiled_loss(host), self.layers)
        if terms:
            # Room for the terms Keras builds later than the state (one loss given
            # to each output of a subclassed model, whose outputs are unknown yet).
            terms = max(terms, TERM_SLOTS)
        return max(0, terms - 1)

    def check_overwrites(self) -> None:
        """`overwrite_with_gradient` variables (float8's): refused with privacy;
        warned of where the window's maximum may not be one step on the window's
        value (a model's own `train_step` and float8's output-gradient
        measurements; a user's variable whose rule gradaccum cannot know)."""
        if getattr(self, "_overwrites_checked", False):
            return
        self._overwrites_checked = True
        variables = self.host.trainable_variables
        if not overwrite.any_of(variables):
            return
        if self.options.privacy is not None:
            raise ValueError(overwrite.privacy_message(overwrite.names(variables)))
        measured = overwrite.gradient_measured(self.layers, variables)
        self.float8_divided = bool(measured) and self.own_train_step is None
        if measured and self.own_train_step is not None:
            warnings.warn(overwrite.own_step_message(measured), stacklevel=3)
        unknown = overwrite.unknown_rules(self.layers, variables)
        if unknown:
            warnings.warn(overwrite.unknown_rule_message(unknown), stacklevel=3)

    def warn_appliers_unknown(self) -> None:
        """End of the data for a model's own step that has not run since its window
        was restored: which optimizers apply it is unknown, so the window stays."""
        open_micro_batches = self.open_micro_batches()
        if open_micro_batches:
            warnings.warn(
                f"gradaccum cannot apply the open window ({open_micro_batches} "
                f"micro-batches) of {type(self.host).__name__} here: which optimizers "
                "apply a model's own `train_step` is read from the step when it "
                "first runs in this process, and it has not run since the window "
                "was restored. The window is left unapplied (kept while the "
                "model accumulates; `gradaccum.disable` drops it).",
                stacklevel=5,
            )

    def open_micro_batches(self) -> int:
        """Micro-batches in the open window (0 without a state): every optimizer's
        window saw the same micro-batches, the longest counts."""
        if self.state is None:
            return 0
        return max((int(a) + int(b) for a, b in zip(self.window_values("micro_step"),
                                                     self.window_values("window_skipped"))),
                   default=0)

    def forget(self) -> None:
        """Drops the state (a new compile): it is made again before training, with
        the open window's values, which nothing may lose silently."""
        if self.state is not None:
            # The windows, not the epoch's position: a new fit starts an epoch.
            saved = {name: variable.numpy()
                     for name, variable in self.saved_variables().items()
                     if name not in saving.EPOCH_FIELDS}
            for prefix, variables, vectors in self.windows():
                saved = saving.keyed_by_variable(saved, variables, prefix, vectors)
            self._pending = {**saved, **self._pending}
        self.drop_state()
        host = self.host
        if (self._pending and host is not None and host.built
                and getattr(host, "optimizer", None) is not None):
            # The open window lives on at once (seen by `save_weights`, `disable`
            # and `open_micro_batches` before the next fit).
            self.ensure_state()

    def save_to(self, store) -> None:
        """Writes the state into `store` (a dict, or Keras's weights store)."""
        if self.state is None:
            return
        for name, variable in self.saved_variables().items():
            # The epoch's length is the running fit's (its hook sets it).
            if name != "epoch_length":
                store[saving.PREFIX + name] = saving.storable(variable.numpy())

    def load_from(self, store) -> None:
        """Restores what `save_to` wrote; values the state has no place for yet
        wait until it has."""
        self._pending = saving.loaded(store)
        # A file written before `outside_fit` was saved (or by a fit) has no window
        # left by `train_on_batch` calls: whatever calls this model made before the
        # load, the window loaded goes on.
        self._pending.setdefault("outside_fit", np.asarray(False))
        if self._pending and getattr(self.host, "optimizer", None) is not None:
            self.ensure_state()
            self.restore_pending()
        # Before compile the values wait: the state is made before training.

    def restore_pending(self) -> None:
        """Gives the state the values `load_from` (or a compile) left waiting."""
        if not self._pending or self.state is None:
            return
        for prefix, variables, vectors in self.windows():
            saving.to_slots(self._pending, variables, prefix, vectors)
        saving.restore(self.saved_variables(), self._pending)

    # Logs and warnings ------------------------------------------------------------------

    def skipped(self) -> int:
        """Micro-batches skipped for a non-finite gradient: every optimizer's window
        saw the same micro-batches, the one that skipped most counts."""
        if self.state is None:
            return 0
        return max(self.window_values("skipped"), default=0)

    def inexact(self) -> bool:
        """Whether a window's loss terms had normalizers of other ratios."""
        return bool(self.fit_field("inexact").numpy())

    def loss_scaled(self) -> bool:
        return kc.is_loss_scale_optimizer(getattr(self.host, "optimizer", None))

    def write_logs(self, logs) -> None:
        """Writes gradaccum's entries into an epoch's `logs` (after its end-of-data
        window closed)."""
        if logs is None or self.state is None:
            return
        iterations, micro_batches, weight = self.last_window()
        if iterations is not None:
            logs["updates"] = float(iterations)
        logs["window_micro_batches"] = float(micro_batches)
        logs["window_weight"] = float(weight)
        if fit_logs.skips_possible(self.policy, self.loss_scaled()):
            logs["skipped"] = float(self.skipped())
        search = self.auto_size
        if search is not None and search.chosen is not None:
            logs["micro_batch_size"] = float(search.chosen)
        privacy = self.options.privacy
        if privacy is not None and privacy.logs_epsilon:
            logs["epsilon"] = spent(self.options.privacy, self.privacy_record())

    def warn(self) -> None:
        """The epoch's warnings, each once: inexact weighting, skipped micro-batches
        (not under loss scaling, which skips by design), a repeated optimizer."""
        if self.state is None:
            return
        if self.inexact() and "inexact" not in self._warned:
            self._warned.add("inexact")
            messages.warn_inexact(stacklevel=4)
        if (self.float8_divided and "unequal" not in self._warned
                and bool(self.fit_field("unequal").numpy())):
            self._warned.add("unequal")
            warnings.warn(self.unequal_message(), stacklevel=4)
        skipped = self.skipped() - self.skipped_at_start
        if (self.options.nonfinite == "skip" and skipped > 0 and not self.loss_scaled()
                and "skipped" not in self._warned):
            self._warned.add("skipped")
            warn_skipped(skipped, stacklevel=4)
        message = self.repeat_warning()
        if message is not None and "repeated" not in self._warned:
            self._warned.add("repeated")
            warnings.warn(message, stacklevel=4)
        if self.own_train_step is not None and self.options.window.constant != 1:
            # What the model's own step does that a window of several micro-batches
            # cannot reproduce, as `audit` names it (a repeated optimizer is said
            # above, at more length).
            for key, text in self.findings().step_causes():
                if key != "repeated" and key not in self._warned:
                    self._warned.add(key)
                    warnings.warn(f"Accumulation is approximate for this model. {text}",
                                  stacklevel=4)

    def data_ends(self) -> None:
        """Before the window the data ends in closes: notes a float8 window flushed
        short of its length where the data ended before the epoch's known length or
        at an end `fit` could not know (for `unequal_message`)."""
        options = self.options
        if (not self.float8_divided or self.state is None or options.partial != "flush"
                or options.split or options.window.weight_per_update is not None
                or not max(self.window_values("micro_step"), default=0)):
            return
        length = int(self.fit_field("epoch_length").numpy())
        if length <= 0 or int(self.fit_field("epoch_step").numpy()) < length:
            self.short_end = True

    def unequal_message(self) -> str:
        """Why a float8 window's weight differed from the one its micro-batches were
        divided by, as far as this fit's settings and its ends tell
        (`overwrite.unequal_message`)."""
        options = self.options
        budget = options.window.weight_per_update is not None and not options.split
        return overwrite.unequal_message(
            short_end=self.short_end, budget=budget,
            weights=options.weighting != "uniform" and not budget,
            skips=self.skipped() > self.skipped_at_start,
        )

    def size_chosen(self) -> None:
        """`micro_batch_size="auto"` ran a batch: the host's `micro_batch_size`
        follows the search, which says once (when `fit` is verbose) where it
        settled."""
        epochs.size_chosen(self)

    # The audit and privacy ----------------------------------------------------------------
