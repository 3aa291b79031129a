"""What crosses devices per update under keras.distribution.DataParallel on JAX.

    python benchmarks/jax_distribution.py [--devices 4] [--k 4] [--b 32]

Compiles the train step Keras runs (the model's `train_step`, jitted with the state
donated) for plain Keras at batch k x b, gradaccum with `steps=k` at batch b (one
micro-batch per call, k calls per update) and gradaccum's split mode at batch k x b
with `micro_batch_size=b` (one call per update), on N virtual CPU devices, and reads
XLA's optimized HLO: every all-reduce, the bytes it reduces, and where it runs (in
every call, inside the split step's loop over micro-batches, or inside the branch that
applies an update). The bytes per update follow from how often each part runs. The
model is the MLP of benchmarks/jax_builtin.py (784-512-512-10, Adam). Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import re

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--k", type=int, default=4, help="micro-batches per update")
parser.add_argument("--b", type=int, default=32, help="micro-batch size")
parser.add_argument("--json", default=None, help="also write the results here")
args = parser.parse_args()
os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import gradaccum  # noqa: E402
from gradaccum.attach import accumulation_of  # noqa: E402

BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f64": 8, "s64": 8}
SHAPE = re.compile(r"(f32|f16|bf16|s32|u32|pred|f64|s64)\[([0-9,]*)\]")


def make(options):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    if options is not None:
        model = gradaccum.accumulate(model, **options)
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def hlo_of(model, batch):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 784)).astype("float32")
    y = rng.integers(0, 10, size=(batch,)).astype("int32")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # builds the state
    if accumulation_of(model) is not None:
        accumulation_of(model).ensure_state()
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    distribution = keras.distribution.distribution()
    data = tuple(
        jax.device_put(t, distribution.get_data_layout(t.shape).backend_layout)
        for t in (x, y)
    )
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, data).compile()
    return compiled.as_text()


def computations(text):
    """Each HLO computation's name and its lines."""
    blocks, name = {}, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            name = header.group(1)
            blocks[name] = []
        elif name is not None:
            blocks[name].append(line)
    return blocks


def all_reduces(text):
    """(computation, bytes) of each all-reduce in the optimized HLO."""
    found = []
    for name, lines in computations(text).items():
        for line in lines:
            if " all-reduce(" not in line and " all-reduce-start(" not in line:
                continue
            result = line.split("=", 1)[1].split("all-reduce", 1)[0]
            size = 0
            for dtype, dims in SHAPE.findall(result):
                count = 1
                for d in filter(None, dims.split(",")):
                    count *= int(d)
                size += count * BYTES[dtype]
            found.append((name, size))
    return found


REFERENCE = re.compile(
    r"(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def where(name, text):
    """Where computation `name` runs: inside the split step's loop over micro-batches
    ("loop"), inside a conditional's branch (the update: "update"), or in every call."""
    graph, loops, branches = {}, set(), set()
    for computation, lines in computations(text).items():
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

    def inside(roots):
        seen, todo = set(), list(roots)
        while todo:
            current = todo.pop()
            if current == name:
                return True
            if current not in seen:
                seen.add(current)
                todo.extend(graph.get(current, ()))
        return False

    if inside(loops):
        return "loop"
    if inside(branches):
        return "update"
    return "call"


def main():
    k, b, devices = args.k, args.b, args.devices
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:devices])
    )
    gradients = None
    rows = []
    for label, options, batch, calls, loops in [
        (f"plain Keras, batch {k * b}", None, k * b, 1, 0),
        (f"gradaccum steps={k}, batch {b}", {"steps": k}, b, k, 0),
        (f"gradaccum micro_batch_size={b}, batch {k * b}", {"micro_batch_size": b},
         k * b, 1, k),
    ]:
        model = make(options)
        if gradients is None:
            gradients = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        text = hlo_of(model, batch)
        per_place = {"call": 0, "loop": 0, "update": 0}
        counts = {"call": 0, "loop": 0, "update": 0}
        for name, size in all_reduces(text):
            place = where(name, text)
            per_place[place] += size
            counts[place] += 1
        # Per update: every call's all-reduces `calls` times; the split loop's once per
        # micro-batch (k) in its one call; the update's once.
        per_update = (per_place["call"] * calls + per_place["loop"] * loops
                      + per_place["update"])
        rows.append({
            "run": label, "all_reduces": counts, "bytes": per_place,
            "bytes_per_update": per_update, "gradient_bytes": gradients,
            "per_update_over_gradient": per_update / gradients,
        })
    keras.distribution.set_distribution(None)
    print(f"DataParallel on {devices} virtual CPU devices, k={k}, b={b}; "
          f"gradient size {gradients / 2**20:.2f} MiB (float32)")
    print("| run | all-reduces (every call / split loop / update branch) | "
          "MiB per update | / gradient size |")
    print("| --- | --- | ---: | ---: |")
    for row in rows:
        c = row["all_reduces"]
        print(f"| {row['run']} | {c['call']} / {c['loop']} / {c['update']} | "
              f"{row['bytes_per_update'] / 2**20:.2f} | {row['per_update_over_gradient']:.2f} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
