"""What one cell of `equal.py`'s grids trains, and how its ratios are summed up:
`make(name, workload, b, k, spe)` returns a function that trains one epoch as
contender `name` (plain `fit`, Keras's built-in accumulation, gradaccum's
`accumulate`), and `count` says how many cells meet a goal. `equal.py` and
`equal_memory.py` both use it (neither imports the other).
"""

from __future__ import annotations

import statistics


def compiled(name: str, workload: str, k: int, spe: int):
    """A model of `workload` compiled as contender `name` (Adam 1e-3, the workload's
    loss; a KerasHub task adds its own default metrics, the same for every contender)."""
    import keras
    import workloads

    model = workloads.build(workload)
    if name == "builtin":
        optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=k)
    else:
        optimizer = keras.optimizers.Adam(1e-3)
    if name in ("accumulate", "unscreened", "unfollowed"):
        import gradaccum

        # unscreened: no non-finite screen; unfollowed: Keras's BatchNormalization
        # layers move per micro-batch (not followed through the window).
        nonfinite = "apply" if name == "unscreened" else "skip"
        moving = "micro_batch" if name == "unfollowed" else "window"
        model = gradaccum.accumulate(model, steps=k, nonfinite=nonfinite,
                                     moving_statistics=moving)
    elif name not in ("plain", "builtin"):
        raise ValueError(f"unknown contender {name!r}")
    model.compile(optimizer, workloads.loss(), steps_per_execution=spe)
    return model


def make(name: str, workload: str, b: int, k: int, spe: int):
    """A function `train(arrays)` that trains one epoch of `arrays` (`fit`'s `x`, `y`
    and `sample_weight`, as `workloads.fit_data` gives them) in micro-batches of b."""
    model = compiled(name, workload, k, spe)

    def train(arrays):
        model.fit(**arrays, batch_size=b, epochs=1, shuffle=False, verbose=0)

    return train


def count(values, goal: float, at_least: bool = True) -> str:
    met = sum(v >= goal if at_least else v <= goal for v in values)
    return (f"median {statistics.median(values):.2f}, range {min(values):.2f}-"
            f"{max(values):.2f}; {'>=' if at_least else '<='} {goal} in {met} of "
            f"{len(values)} cells.")
