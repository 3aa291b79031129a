"""Two compiled steps on JAX, chosen on the host: one that only adds a micro-batch
to its window, one that may also close it.

The whole step closes a window inside a `lax.cond` and empties the sums under a
`where` at every micro-batch, because on the device any micro-batch may be the one
that closes. On a GPU both cost at every micro-batch: XLA's conditional reads its
predicate back to the host and splits the step's CUDA graph, and the `where`
passes over every sum (0.5 GB at GPT-2 small). Where the window has a fixed length,
the host knows which micro-batches may close (`gradaccum.core.host_window`): the
others run a step compiled without the close (`TrainStep(..., closes=False)`: no
conditional, no emptying), and the window's k-th runs the whole step. Both are
compiled once, as Keras compiles its step.

Only on an accelerator (`worth_it`): on a CPU, XLA runs a conditional inline, and
the second compile cost more than it saved (measured on 2 cores, `benchmarks/
compare.py`: the MLP cell 1.01x at one micro-batch per call, 1.10x at four, a
Transformer 0.98x; the JAX test suite's compile time +24%).

The host's count starts from the state as each epoch begins (one read). The step
without the close records an error where its window was due all the same
(`transitions.unclosed`), which `fit` raises at the epoch's end at the latest:
a count gone wrong never trains on silently with windows of another length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from gradaccum.backends.jax import retry
from gradaccum.core.host_window import HostWindow


def worth_it() -> bool:
    """Whether the two steps pay for their second compile where JAX computes: on a
    GPU or a TPU (a conditional there reads its predicate back to the host), not on
    a CPU."""
    return jax.default_backend() != "cpu"


class Phases:
    """The step `fit` calls once per micro-batch: the micro-batch through the step
    compiled without the close where its window cannot close, else the whole step.

    Args:
        accumulation: the model's JAX `Accumulation` (its `step` and `host`).
    """

    def __init__(self, accumulation) -> None:
        self.accumulation = accumulation
        options = accumulation.options
        self.window = HostWindow(options.window, options.partial)
        self.compiled: dict[bool, Callable[..., Any]] = {}
        # Micro-batches run by each step, for tests and benchmarks.
        self.calls = {True: 0, False: 0}

    def __call__(self, state, data) -> tuple:
        closes = self.window.may_close()
        if closes not in self.compiled:
            step = self.accumulation.step

            def phase(state, data) -> tuple:
                return step(state, data, closes=closes)

            self.compiled[closes] = retry.compiled(self.accumulation.host, phase, state)
        self.calls[closes] += 1
        return self.compiled[closes](state, data)
