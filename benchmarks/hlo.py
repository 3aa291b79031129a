"""Reading XLA's optimized HLO text: each collective, its bytes and where it runs.

    from hlo import collectives
    for found in collectives(compiled.as_text()):
        print(found.kind, found.bytes, found.place)

`place` says how often a collective runs: "call" (in every call of the compiled
function), "loop" (inside a `while`: once per iteration, split mode's micro-batches) or
"update" (inside a conditional's branch: only when a window closes).
`train_step_collectives(model, arrays)` compiles a Keras model's JAX train step as
Keras's trainer does and reads them. Used by benchmarks/jax_distribution.py and
tests/jax_backend/distribution_job.py.
"""

from __future__ import annotations

import re
from typing import NamedTuple

BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f64": 8,
         "s64": 8, "u64": 8, "s8": 1, "u8": 1, "s16": 2, "u16": 2}
SHAPE = re.compile(r"\b(" + "|".join(BYTES) + r")\[([0-9,]*)\]")
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
REFERENCE = re.compile(
    r"(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


class Collective(NamedTuple):
    kind: str  # one of KINDS
    computation: str  # the HLO computation it sits in
    bytes: int  # the bytes of its result (for an all-reduce, what it reduces)
    place: str  # "call", "loop" or "update"


def computations(text: str) -> dict:
    """Each HLO computation's name and its lines."""
    blocks: dict = {}
    name = None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            name = header.group(1)
            blocks[name] = []
        elif name is not None:
            blocks[name].append(line)
    return blocks


def _size(result: str) -> int:
    size = 0
    for dtype, dims in SHAPE.findall(result):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        size += count * BYTES[dtype]
    return size


def _places(blocks: dict) -> dict:
    """Each computation's place: "loop" if a `while` body reaches it, else "update"
    if a conditional's branch does, else "call"."""
    graph, loops, branches = {}, set(), set()
    for computation, lines in blocks.items():
        called = set()
        for line in lines:
            for kind, callee in REFERENCE.findall(line):
                called.add(callee)
                if kind == "body":
                    loops.add(callee)
                elif kind in ("true_computation", "false_computation"):
                    branches.add(callee)
            for group in BRANCHES.findall(line):
                for callee in group.split(","):
                    callee = callee.strip().lstrip("%")
                    called.add(callee)
                    branches.add(callee)
        graph[computation] = called

    def reached(roots) -> set:
        seen, todo = set(), list(roots)
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(graph.get(current, ()))
        return seen

    in_loops, in_branches = reached(loops), reached(branches)
    return {name: "loop" if name in in_loops else "update" if name in in_branches
            else "call" for name in blocks}


def collectives(text: str) -> list[Collective]:
    """Every collective of an optimized HLO module (the `-start` half of an
    asynchronous one; its `-done` half is not counted again)."""
    blocks = computations(text)
    places = _places(blocks)
    found = []
    for name, lines in blocks.items():
        for line in lines:
            if "=" not in line:
                continue
            for kind in KINDS:
                if f" {kind}(" in line or f" {kind}-start(" in line:
                    result = line.split("=", 1)[1].split(kind, 1)[0]
                    found.append(Collective(kind, name, _size(result), places[name]))
                    break
    return found


def train_step_collectives(model, arrays) -> list[Collective]:
    """The collectives of `model`'s train step on the batch `arrays` (x, y, ...:
    NumPy arrays), compiled on JAX under the current keras.distribution as Keras's
    trainer compiles it: the state jitted back into the shardings it came with."""
    import jax
    import keras

    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables,
        model.optimizer.variables, model.metrics_variables))
    distribution = keras.distribution.distribution()
    data = tuple(jax.device_put(t, distribution.get_data_layout(t.shape).backend_layout)
                 for t in arrays)
    shardings = jax.tree_util.tree_map(lambda a: a.sharding, state)
    text = jax.jit(model.train_step, out_shardings=(None, shardings)).lower(
        state, data).compile().as_text()
    return collectives(text)
