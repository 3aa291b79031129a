"""Differentially private training (DP-SGD) with accumulation: the options, what a
model must be for them, and the privacy accounting.

DP-SGD clips each example's gradient to an L2 norm `C`, sums the clipped gradients of
the batch, adds Gaussian noise `N(0, sigma^2 C^2)` once and divides by the batch's
number of examples `B`. With accumulation the batch is the window: the noise is added
once per window (per update), not per micro-batch, so its standard deviation in the
update is `sigma C / B` whatever the number of micro-batches; a tool that adds it per
micro-batch puts `sqrt(k)` times too much noise in for the privacy it spends.

The accounting uses Google's `dp-accounting`. It assumes that each update's window is
a Poisson sample of the dataset (each example in it independently, with probability
`q = window / dataset_size`); `fit` draws shuffled windows of a fixed size instead
(sampling without replacement), the practice of DP-SGD libraries, whose epsilon is
reported under the same assumption.
"""

from __future__ import annotations

import math
import numbers
import secrets
from typing import Any

import keras

from gradaccum.core.hints import Integer, Real

ACCOUNTANTS = ("rdp", "pld")
# Privacy's arguments, as a saved AccumulatingModel's config holds them.
PRIVACY_FIELDS = (
    "l2_norm_clip", "noise_multiplier", "seed", "dataset_size", "delta", "accountant"
)

_MISSING_ACCOUNTING = (
    "gradaccum's privacy accounting needs Google's dp-accounting. Install it with:\n"
    "  pip install 'gradaccum[privacy]'    # or: pip install dp-accounting"
)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class Privacy:
    """Differential privacy for `gradaccum.accumulate` and `gradaccum.wrap` (DP-SGD).

    Each example's gradient is clipped to L2 norm `l2_norm_clip` inside its
    micro-batch (per-example gradients computed vectorized), the clipped gradients are
    summed over the window, Gaussian noise with standard deviation
    `noise_multiplier * l2_norm_clip` is added once per window, and the sum is divided
    by the window's number of examples: the optimizer sees that once per update.
    Under several replicas the noise is added once to the global window.

    An example's gradient is that of the model's compiled loss on a batch of that one
    example (its sample weight and mask included). Weight regularizers do not depend
    on the data: their gradient is added to the update as it is, neither clipped nor
    noised.

    Args:
        l2_norm_clip: C, the largest L2 norm of one example's gradient (over all
            trainable variables), a number > 0.
        noise_multiplier: sigma, the noise's standard deviation in units of C, a
            number >= 0 (0: clipping without noise, which protects nothing).
        seed: an integer in [0, 2**63) seeds the noise (reproducible runs, tests);
            `None` (default)
            draws a seed from the operating system's entropy for each model, which is
            what private training needs: noise that can be predicted protects nothing.
        dataset_size: the number of training examples; with `delta`, `fit` logs
            `epsilon` after each epoch and `gradaccum.privacy_spent(model)` needs
            neither argument.
        delta: the delta of (epsilon, delta)-differential privacy, in (0, 1); usually
            below 1 / dataset_size.
        accountant: `"rdp"` (default: Renyi DP, as TensorFlow Privacy reports) or
            `"pld"` (privacy loss distributions: a tighter epsilon, slower).

    Raises:
        ValueError: `l2_norm_clip <= 0`, `noise_multiplier < 0`, `delta` outside
            (0, 1), a `dataset_size` that is not an integer >= 1, a `seed` that is not
            an integer in [0, 2**63), an unknown `accountant`.

    Examples:

        >>> import keras, numpy as np, gradaccum
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> privacy = gradaccum.Privacy(l2_norm_clip=1.0, noise_multiplier=1.1, seed=0,
        ...                             dataset_size=64, delta=1e-5)
        >>> model = gradaccum.accumulate(model, steps=4, privacy=privacy)
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((64, 4)), np.zeros((64, 1)), batch_size=4, epochs=2,
        ...                     verbose=0)
        >>> history.history["updates"]  # 16 micro-batches of 4 per epoch: 4 windows of 16
        [4.0, 8.0]
        >>> round(gradaccum.privacy_spent(model), 1) == round(history.history["epsilon"][-1], 1)
        True
    """

    def __init__(self, l2_norm_clip: Real, noise_multiplier: Real, seed: Integer | None = None,
                 *, dataset_size: Integer | None = None, delta: Real | None = None,
                 accountant: str = "rdp") -> None:
        if not _is_number(l2_norm_clip) or not math.isfinite(clip := float(l2_norm_clip)) \
                or clip <= 0:
            raise ValueError(
                "`l2_norm_clip` must be a finite number > 0. "
                f"Received: l2_norm_clip={l2_norm_clip!r}"
            )
        if not _is_number(noise_multiplier) \
                or not math.isfinite(multiplier := float(noise_multiplier)) or multiplier < 0:
            raise ValueError(
                "`noise_multiplier` must be a finite number >= 0. "
                f"Received: noise_multiplier={noise_multiplier!r}"
            )
        if seed is not None and (not isinstance(seed, numbers.Integral)
                                 or isinstance(seed, bool) or not 0 <= int(seed) < 2**63):
            raise ValueError(
                f"`seed` must be an integer in [0, 2**63) or None. Received: seed={seed!r}"
            )
        self.l2_norm_clip = float(l2_norm_clip)
        self.noise_multiplier = float(noise_multiplier)
        self.seed = None if seed is None else int(seed)
        self.dataset_size = check_dataset_size(dataset_size)
        self.delta = check_delta(delta)
        if accountant not in ACCOUNTANTS:
            raise ValueError(
                f"`accountant` must be one of {', '.join(repr(a) for a in ACCOUNTANTS)}. "
                f"Received: accountant={accountant!r}"
            )
        self.accountant = accountant

    @property
    def noise_stddev(self) -> float:
        """The standard deviation of the noise added to a window's clipped sum."""
        return self.noise_multiplier * self.l2_norm_clip

    @property
    def logs_epsilon(self) -> bool:
        """Whether `fit` logs `epsilon` (both `dataset_size` and `delta` given)."""
        return self.dataset_size is not None and self.delta is not None

    def noise_seed(self) -> int:
        """The seed of one model's noise: `seed`, or a fresh one from the operating
        system's entropy (a non-negative int64)."""
        return self.seed if self.seed is not None else secrets.randbits(62)

    def __repr__(self) -> str:
        return (
            f"Privacy(l2_norm_clip={self.l2_norm_clip}, "
            f"noise_multiplier={self.noise_multiplier}, seed={self.seed}, "
            f"dataset_size={self.dataset_size}, delta={self.delta}, "
            f"accountant={self.accountant!r})"
        )


def check_dataset_size(dataset_size: Any, required: bool = False) -> int | None:
    if dataset_size is None and not required:
        return None
    if not isinstance(dataset_size, numbers.Integral) or isinstance(dataset_size, bool) \
            or dataset_size < 1:
        raise ValueError(
            "`dataset_size` must be an integer >= 1 (the number of training examples). "
            f"Received: dataset_size={dataset_size!r}"
        )
    return int(dataset_size)


def check_delta(delta: Any, required: bool = False) -> float | None:
    if delta is None and not required:
        return None
    if not _is_number(delta) or not 0 < delta < 1:
        raise ValueError(f"`delta` must be a number in (0, 1). Received: delta={delta!r}")
    return float(delta)


def check_privacy(privacy: Any) -> Privacy | None:
    """`privacy` as given to `accumulate` or `wrap`: a `Privacy` or None."""
    if privacy is not None and not isinstance(privacy, Privacy):
        raise ValueError(
            "`privacy` must be a gradaccum.Privacy or None. "
            f"Received: privacy={privacy!r} of type {type(privacy).__name__}"
        )
    return privacy


def check_options(options: Any) -> None:
    """The accumulation options (`core.options.Options`, which calls this) private
    training works with: each example weighs one (`weighting="exact"`, which privacy
    turns into a count of examples), a mean."""
    if options.weighting != "exact" or options.reduction != "mean":
        raise ValueError(
            '`weighting` must be "exact" and `reduction` "mean" with `privacy`: each '
            "example's clipped gradient weighs one and the window's sum is divided by "
            f"its number of examples. Received: weighting={options.weighting!r}, "
            f"reduction={options.reduction!r}"
        )


def check_model(model: keras.Model, own_train_step: bool, layers: list) -> None:
    """Refuses a model whose examples' gradients cannot be told apart: its own
    `train_step` (gradaccum cannot see its examples), its own `compute_loss` (a loss
    that may mix examples), or a layer that mixes examples (batch normalization) or
    adds a loss from its inputs (an activity regularizer or `add_loss`, computed over
    the micro-batch). `layers`: the model's layers, nested ones included."""
    name = model.name
    if own_train_step:
        raise ValueError(
            "`privacy` needs Keras's default train step: gradaccum computes each "
            "example's gradient itself. Received: model "
            f"{name!r} of class {type(model).__name__}, which defines its own train_step."
        )
    if type(model).compute_loss is not keras.Model.compute_loss:
        raise ValueError(
            "`privacy` needs a loss that can be split per example: the model's compiled "
            f"loss. Received: model {name!r} of class {type(model).__name__}, which "
            "defines its own compute_loss (it may mix examples, as a contrastive loss "
            "does)."
        )
    if model.built:
        check_layers(model, layers)


def check_layers(model: keras.Model, layers: list) -> None:
    """The layer checks of `check_model` (on a built model), over `layers` (the
    model's, nested ones included)."""
    for layer in layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            raise ValueError(
                "`privacy` needs layers that compute each example on its own: batch "
                "normalization mixes the examples of a micro-batch (its statistics). "
                f"Received: model {model.name!r} with BatchNormalization layer "
                f"{layer.name!r}. Use LayerNormalization or GroupNormalization instead."
            )
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(
                "`privacy` needs losses that can be split per example: an activity "
                "regularizer is computed over the micro-batch. Received: model "
                f"{model.name!r} with layer {layer.name!r} that has an "
                "activity_regularizer."
            )


def per_example_inputs(model: keras.Model, compile_loss: Any, x: Any, y: Any,
                       sample_weight: Any) -> tuple[Any, dict[str, Any]]:
    """What every backend's per-example pass maps over: the model's compiled loss
    (`compile_loss`, refused when None) and the micro-batch's parts as one dict (`x`,
    and `y` and `sample_weight` when given)."""
    if compile_loss is None:
        raise ValueError(
            "`privacy` needs the model's compiled loss: each example's gradient is that "
            f"of its loss. Received: model {model.name!r} compiled without a loss."
        )
    elements = {"x": x}
    if y is not None:
        elements["y"] = y
    if sample_weight is not None:
        elements["sample_weight"] = sample_weight
    return compile_loss, elements


def check_example_losses(model: keras.Model, losses: list, regularized: int) -> None:
    """Refuses a model whose layers add losses in their call (`add_loss`): computed
    over the micro-batch, they cannot be split per example. `losses`: what the
    model's stateless call returned for one example, the weight regularizers' terms
    first (`regularized` of them)."""
    if len(losses) > regularized:
        raise ValueError(
            "`privacy` needs losses that can be split per example: a layer of model "
            f"{model.name!r} adds a loss in its call (`add_loss`), computed over "
            "the micro-batch. Received: a model whose layers add losses."
        )


def regularized_variables(model: keras.Model) -> int:
    """How many of the model's trainable variables have a weight regularizer."""
    return sum(getattr(v, "regularizer", None) is not None
               for v in model.trainable_variables)


def clip_factors(squared_norms: Any, l2_norm_clip: float) -> Any:
    """Each example's clipping factor `C / max(norm, C)` (1 within the bound), from
    its squared L2 norm (float32)."""
    ops = keras.ops
    clip = ops.convert_to_tensor(l2_norm_clip, "float32")
    return clip / ops.maximum(ops.sqrt(squared_norms), clip)


def sampling_rate(window: float, dataset_size: int) -> float:
    """`q = window / dataset_size`, checked: a window larger than the dataset is not a
    sample of it."""
    if window > dataset_size:
        raise ValueError(
            "`dataset_size` must be at least the number of examples in a window. "
            f"Received: dataset_size={dataset_size} with windows of {window:g} examples"
        )
    return window / dataset_size


def check_fit(options: Any, x: Any, batch_size: int | None) -> None:
    """As `fit` starts with arrays: a `Privacy.dataset_size` smaller than the window
    the options make of them is refused before training (a window larger than the
    dataset is not a sample of it)."""
    privacy = options.privacy
    if privacy is None or privacy.dataset_size is None or options.weight_per_update:
        return
    leaves = keras.tree.flatten(x) if x is not None else []
    if not leaves or not hasattr(leaves[0], "shape") or not leaves[0].shape:
        return  # a dataset or a generator: its batches are not known here
    samples = int(leaves[0].shape[0])
    batch = min(batch_size or 32, samples)
    if options.split:
        window = batch
    elif options.window.constant:
        window = min(options.window.constant * batch, samples)
    else:
        return
    sampling_rate(window, privacy.dataset_size)


def epsilon(noise_multiplier: float, sampling_rate: float, updates: int, delta: float,
            accountant: str = "rdp") -> float:
    """The epsilon of (epsilon, delta)-DP after `updates` Poisson-sampled Gaussian
    updates, from `dp-accounting`: `inf` without noise, 0 before any update."""
    try:
        import dp_accounting
    except ImportError as error:  # pragma: no cover (the test install provides it)
        raise ImportError(_MISSING_ACCOUNTING) from error
    if updates <= 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
        ),
        int(updates),
    )
    if accountant == "pld":
        ledger = dp_accounting.pld.PLDAccountant()
    else:
        ledger = dp_accounting.rdp.RdpAccountant()
    ledger.compose(event)
    return float(ledger.get_epsilon(delta))


def spent(privacy: Privacy, record: tuple[int, float], dataset_size: Integer | None = None,
          delta: Real | None = None) -> float:
    """`privacy_spent`: the epsilon of the updates made, from `record` (the updates
    and the most examples a window held) and `privacy`'s settings."""
    dataset_size = check_dataset_size(
        privacy.dataset_size if dataset_size is None else dataset_size, required=True
    )
    delta = check_delta(privacy.delta if delta is None else delta, required=True)
    assert dataset_size is not None and delta is not None  # required=True: checked
    updates, window = record
    if updates == 0:
        return 0.0
    rate = sampling_rate(window, dataset_size)
    return epsilon(privacy.noise_multiplier, rate, updates, delta, privacy.accountant)
