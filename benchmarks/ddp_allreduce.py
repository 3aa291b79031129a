"""All-reduces per update under PyTorch DistributedDataParallel: gradaccum against
DDP's usual gradient accumulation, on Keras's torch backend.

    python benchmarks/ddp_allreduce.py [--updates 10] [--micro-batch 32] [--k 1 4 16]

Two processes on 127.0.0.1 (`torch.distributed`, gloo, CPU) each train the same MLP
(784-512-512-10, Adam; the Keras model wrapped in `DistributedDataParallel`) on
micro-batches of their own. For each window k, interleaved, both contenders make
`--updates` timed updates (after one warm-up update):

- plain DDP: each micro-batch's backward synchronized (DDP all-reduces its buckets),
  the usual `loss / k` summed in `.grad`, `optimizer.apply` every k micro-batches;
- gradaccum: each micro-batch's forward and backward inside `acc.no_sync(ddp)`,
  `acc.step(optimizer, grads, weight=len(x))` with `GradientAccumulator(steps=k)`.

Counted per update: DDP's all-reduces (a communication hook around DDP's own
`allreduce_hook`), gradaccum's (`acc.all_reduces`), and the megabytes every
`torch.distributed.all_reduce` call carried (both kinds go through it); timed: the
wall time per update on rank 0 (between barriers). Nothing is asserted. On one
machine's loopback an all-reduce is cheap and DDP overlaps it with the backward
pass, so the times show gradaccum's own work per micro-batch (the non-finite screen,
the in-place sums) more than the communication it saves; the counts and bytes are
what carries over to a network.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

os.environ["KERAS_BACKEND"] = "torch"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CONTENDERS = ("plain DDP (loss / k, synced backward)", "gradaccum no_sync")


class Counts:
    """DDP hook calls; `torch.distributed.all_reduce` calls and bytes (DDP's hook
    and gradaccum's reducer both call it)."""

    def __init__(self):
        self.hook = 0
        self.calls = 0
        self.bytes = 0


def count_all_reduces(counts: Counts) -> None:
    import torch.distributed as dist

    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        counts.calls += 1
        counts.bytes += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce


def counting_hook(counts: Counts, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    counts.hook += 1
    return default_hooks.allreduce_hook(None, bucket)


def build():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])


def run(contender: str, k: int, args, rank: int, counts: Counts) -> dict:
    """`--updates` timed updates of one contender; per-update counts and time."""
    import keras
    import numpy as np
    import torch
    import torch.distributed as dist

    import gradaccum

    model = build()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(counts, counting_hook)
    optimizer = keras.optimizers.Adam(1e-3)
    variables = model.trainable_weights
    optimizer.build(variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(rank)
    x = torch.as_tensor(rng.normal(size=(args.micro_batch, 784)).astype("float32"))
    y = torch.as_tensor(rng.integers(0, 10, size=(args.micro_batch,)).astype("int32"))
    acc = (gradaccum.GradientAccumulator(variables, steps=k)
           if contender == CONTENDERS[1] else None)

    def update():
        for _ in range(k):
            if acc is not None:
                with acc.no_sync(ddp):
                    loss = loss_fn(y, ddp(x, training=True))
                    ddp.zero_grad()
                    loss.backward()
                acc.step(optimizer, [v.value.grad for v in variables], weight=len(x))
            else:
                loss = loss_fn(y, ddp(x, training=True)) / k
                loss.backward()
        if acc is None:
            with torch.no_grad():
                optimizer.apply([v.value.grad for v in variables], variables)
            ddp.zero_grad()

    update()  # warm-up: DDP rebuilds its buckets after the first backward
    dist.barrier()
    hook, calls, size = counts.hook, counts.calls, counts.bytes
    reduces = 0 if acc is None else acc.all_reduces
    start = time.perf_counter()
    for _ in range(args.updates):
        update()
    dist.barrier()
    elapsed = time.perf_counter() - start
    updates = args.updates
    assert int(optimizer.iterations.numpy()) == updates + 1
    return dict(
        ddp=(counts.hook - hook) / updates,
        gradaccum=((0 if acc is None else acc.all_reduces) - reduces) / updates,
        calls=(counts.calls - calls) / updates,
        megabytes=(counts.bytes - size) / updates / 2**20,
        ms=1000 * elapsed / updates,
        parameters=sum(int(np.prod(v.shape)) for v in variables),
    )


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=2)
    counts = Counts()
    count_all_reduces(counts)
    rows = []
    try:
        for k in args.k:
            for contender in CONTENDERS:
                rows.append(dict(k=k, contender=contender,
                                 **run(contender, k, args, args.rank, counts)))
    finally:
        dist.destroy_process_group()
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(rows, args) -> None:
    import keras
    import torch

    print(f"\n2 processes (gloo, CPU, {args.threads} thread each), MLP 784-512-512-10 "
          f"({rows[0]['parameters']:,} parameters), micro-batch {args.micro_batch} per "
          f"process, Adam; {args.updates} timed updates per row; torch {torch.__version__}, "
          f"Keras {keras.__version__}\n")
    print("| k | contender | DDP all-reduces / update | gradaccum all-reduces / update "
          "| all_reduce calls / update | MB all-reduced / update | ms / update |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['k']} | {r['contender']} | {r['ddp']:g} | {r['gradaccum']:g} | "
              f"{r['calls']:g} | {r['megabytes']:.2f} | {r['ms']:.1f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=10, help="timed updates per row")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 16],
                        help="micro-batches per update")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        worker(args)
        return
    out = os.path.join(tempfile.mkdtemp(), "rows.json")
    port = free_port()
    common = ["--updates", str(args.updates), "--micro-batch", str(args.micro_batch),
              "--threads", str(args.threads), "--k", *map(str, args.k)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *common,
                               "--rank", str(rank), "--port", str(port), "--out", out])
             for rank in range(2)]
    try:
        for proc in procs:
            proc.wait(timeout=1800)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(p.returncode for p in procs):
        sys.exit("a process failed")
    with open(out) as f:
        rows = json.load(f)
    print("command: python benchmarks/ddp_allreduce.py " + " ".join(common))
    table(rows, args)


if __name__ == "__main__":
    main()
