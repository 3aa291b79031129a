"""Runs of the seed experiment: one configuration (k, b, iterations), several seeds."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from gradaccum.experiments.data import Dataset
from gradaccum.experiments.models import build_model, build_optimizer


@dataclass(frozen=True)
class Config:
    """One way to make updates: k micro-batches of b samples, `iterations` micro-batches.

    `split=False`: fit gets batches of b and `gradaccum.wrap(steps=k)` applies every
    k of them. `split=True`: fit gets batches of k*b and
    `gradaccum.wrap(micro_batch_size=b)` splits each inside the step. With the same
    seed both see the same samples in the same order and make the same updates.
    `plain=True` (k = 1): plain Keras training, without gradaccum (the contrast).
    `max_steps`: k follows the gradient noise scale (`gradaccum.NoiseScaleSchedule`
    on batches of b), from `steps` (its first and least k) up to `max_steps`.
    """

    steps: int
    batch_size: int
    iterations: int
    split: bool = False
    plain: bool = False
    max_steps: int | None = None

    @property
    def follows(self) -> bool:
        """Whether k follows the noise scale."""
        return self.max_steps is not None

    @property
    def form(self) -> str:
        return "split" if self.split else "steps"

    @property
    def updates(self) -> int | None:
        """The updates of a run; None where k follows the noise scale (the runs
        count them)."""
        return None if self.follows else self.iterations // self.steps

    @property
    def samples(self) -> int:
        return self.iterations * self.batch_size

    @property
    def measures_noise(self) -> bool:
        """Whether its windows can read the noise scale: gradaccum's windows of two
        micro-batches or more (a window of one, on one device, measures nothing)."""
        return not self.plain and (self.steps >= 2 or self.follows)

    @property
    def steps_label(self) -> str:
        return f"{self.steps}..{self.max_steps}" if self.follows else str(self.steps)

    @property
    def label(self) -> str:
        return f"{self.steps_label}x{self.batch_size}"


@dataclass
class RunResult:
    """What one run measured: final test accuracy (percent) and its curve (updates,
    accuracy) at each evaluation point; with the noise scale, its reading at each
    point (`noise_scale`: B_simple in samples from the windows since the point
    before, None where it is NaN) and, where k follows it, the k each stretch
    trained with (`steps`). Empty lists where not measured."""

    seed: int
    accuracy: float
    wall_time: float
    samples_per_second: float
    curve: list[tuple[int, float]] = field(default_factory=list)
    noise_scale: list[float | None] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    # With DP-SGD: the epsilon the run spent (None without privacy).
    epsilon: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def derive_seeds(seed: int, runs: int) -> list[int]:
    """One independent seed per run, derived from the experiment's seed."""
    return [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(runs)]


def sample_order(seed: int, size: int, count: int) -> np.ndarray:
    """The first `count` sample indices of a run: epoch after epoch of `size` samples,
    each epoch a fresh permutation drawn from `seed`.

    Every configuration of a run cuts its batches from this one stream in order, so
    k batches of b and one batch of k*b hold the same samples, whatever the sizes.
    NumPy draws it: the same on every backend.

    >>> sample_order(0, 4, 6).tolist()
    [2, 0, 1, 3, 3, 2]
    """
    rng = np.random.default_rng(seed)
    epochs = -(-count // size)
    return np.concatenate([rng.permutation(size) for _ in range(epochs)])[:count]


def _evaluation_chunks(iterations: int, evaluations: int) -> int:
    """The largest number of equal chunks (<= evaluations) that splits the run."""
    for count in range(min(evaluations, iterations), 0, -1):
        if iterations % count == 0:
            return count
    return 1


def run_once(
    config: Config,
    data: Dataset,
    *,
    seed: int,
    model: str = "mlp",
    optimizer: str = "adam",
    learning_rate: float = 1e-3,
    evaluations: int = 10,
    jit_compile="auto",
    steps_per_execution: int = 100,
    privacy: dict | None = None,
    noise_scale: bool = False,
) -> RunResult:
    """Trains a fresh network with `gradaccum.wrap` (in the form `config` says; plain
    Keras for `config.plain`) and
    returns its test accuracy. `privacy`: `gradaccum.Privacy`'s arguments (DP-SGD),
    and `seeded`: whether the noise takes the run's seed (else the system's entropy).
    `noise_scale`: read the gradient noise scale at each evaluation point, where the
    configuration's windows can (`Config.measures_noise`)."""
    import keras

    import gradaccum

    # (Not keras.utils.set_random_seed: it imports TensorFlow wherever it is
    # installed, with its start-up lines, to seed it too. The run's randomness is
    # its initial weights and its order of samples, both drawn from `seed`.)
    keras.utils.clear_session()
    net = build_model(model, seed)
    private = None
    if privacy is not None:
        privacy = dict(privacy)
        # The run's seed (printed) only when asked for: predictable noise protects
        # nothing.
        noise_seed = seed if privacy.pop("seeded", False) else None
        private = gradaccum.Privacy(seed=noise_seed, **privacy)
    # Each fit below is one Keras epoch: the epoch's logs read the noise scale of
    # its windows, at no cost beyond one squared norm per micro-batch.
    measure = noise_scale and config.measures_noise
    if config.plain:
        if config.steps != 1 or config.split or private is not None:
            raise ValueError("plain Keras training is one update per batch (k = 1), "
                             f"without privacy. Received: {config}")
        trainer, batches, batch_size = net, config.iterations, config.batch_size
    elif config.split:
        # One batch of k*b per update, split inside the step.
        trainer = gradaccum.wrap(net, micro_batch_size=config.batch_size,
                                 privacy=private, noise_scale=measure)
        batches, batch_size = config.iterations // config.steps, config.steps * config.batch_size
    else:
        steps: int | gradaccum.NoiseScaleSchedule = config.steps
        if config.follows:
            # k from the last epoch's noise scale, at each epoch's start.
            steps = gradaccum.NoiseScaleSchedule(
                config.batch_size, min_steps=config.steps, max_steps=config.max_steps)
        # "carry": windows run on across the evaluation points, never cut by them.
        trainer = gradaccum.wrap(net, steps=steps, partial="carry", privacy=private,
                                 noise_scale=measure)
        batches, batch_size = config.iterations, config.batch_size
    chunks = _evaluation_chunks(batches, evaluations)
    per_chunk = batches // chunks
    trainer.compile(
        optimizer=build_optimizer(optimizer, learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        # (Keras's torch trainer runs one batch per call.)
        steps_per_execution=(1 if keras.backend.backend() == "torch"
                             else min(per_chunk, steps_per_execution)),
        jit_compile=jit_compile,
    )
    order = sample_order(seed, len(data.x_train), batches * batch_size)
    updates, accuracy, noise, steps_taken = [], [], [], []
    start = time.perf_counter()
    for chunk in np.split(order, chunks):
        # Each chunk's samples in stream order; fit cuts them into batches as they come.
        history = trainer.fit(data.x_train[chunk], data.y_train[chunk],
                              batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        scores = trainer.evaluate(data.x_test, data.y_test, batch_size=2000, verbose=0,
                                  return_dict=True)
        updates.append(int(history.history["updates"][-1]) if not config.plain
                       else int(trainer.optimizer.iterations))
        accuracy.append(100.0 * float(scores["accuracy"]))
        if measure:
            reading = float(history.history["noise_scale"][-1])
            noise.append(reading if math.isfinite(reading) else None)
        if config.follows:
            steps_taken.append(int(history.history["steps"][-1]))
    wall = time.perf_counter() - start
    return RunResult(
        seed=seed,
        accuracy=accuracy[-1],
        wall_time=wall,
        samples_per_second=config.iterations * config.batch_size / wall,
        curve=list(zip(updates, accuracy)),
        epsilon=None if private is None else gradaccum.privacy_spent(trainer),
        noise_scale=noise,
        steps=steps_taken,
    )


def summarize(results: list[RunResult]) -> tuple[float, float]:
    """Mean and population standard deviation (ddof=0) of the accuracies."""
    acc = np.array([r.accuracy for r in results])
    return float(acc.mean()), float(acc.std(ddof=0))
