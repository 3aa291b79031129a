"""`torch.distributed` for a `GradientAccumulator`: one all-reduce per update.

Each process accumulates its own micro-batches (a model in
`DistributedDataParallel` runs their backward passes under `no_sync`, so DDP
communicates nothing); when a window closes, its sums, total weight and received
counts travel in one flat buffer through one `all_reduce` (a sum), and every process
applies `G = sum_r S_r / sum_r W_r`: the update of one process training on the
global window, the processes weighed by their loss normalizers (DDP averages them
instead, which is exact only for equal shares). A weight budget compares the global
window's weight: one scalar all-reduce per micro-batch.

With `sums="sharded"` (`ShardedSums`) each of the W processes keeps 1/W of the
sums instead: every micro-batch's weighted gradients are reduce-scattered into the
shards (each process receives the processes' sum of its part), and a closing window
gathers them whole (one all-gather) besides the one all-reduce of its weight and
received counts. ZeRO-2's trade: 4 bytes per parameter over W of memory against a
reduce-scatter per micro-batch.
"""

from __future__ import annotations

import torch


def default_group(process_group="auto"):
    """The process group a window is reduced over: `"auto"` is torch.distributed's
    default group where it is initialized with several processes, else None (one
    process)."""
    if process_group is None:
        return None
    import torch.distributed as dist

    if isinstance(process_group, str) and process_group == "auto":
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist.group.WORLD
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise ValueError(
            '`process_group` must be "auto", None or a torch.distributed ProcessGroup. '
            f"Received: process_group={process_group!r}"
        )
    return process_group


class Reducer:
    """Sums a window over the processes of `group`; counts its all-reduces.

    Args:
        group: a `torch.distributed` process group.
    """

    def __init__(self, group):
        self.group = group
        self.all_reduces = 0
        self.reduce_scatters = 0
        self.all_gathers = 0

    def fields(self, fields):
        """`fields` (the window's weight and received counts) summed over the
        processes, in one all-reduce."""
        _, reduced = self.window([], fields)
        return reduced

    def window(self, sums, fields):
        """`(sums, fields)` summed over the processes, in one all-reduce of one
        float buffer (the sums in their dtype's float32 or float64)."""
        import torch.distributed as dist

        dtype = torch.float64 if any(s.dtype == torch.float64 for s in sums) else torch.float32
        names = sorted(fields)
        parts = [s.detach().reshape(-1).to(dtype) for s in sums]
        device = parts[0].device if parts else torch.as_tensor(fields[names[0]]).device
        parts += [torch.as_tensor(fields[n]).reshape(-1).to(device=device, dtype=dtype)
                  for n in names]
        flat = torch.cat(parts)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        self.all_reduces += 1
        out, offset = [], 0
        for s in sums:
            out.append(flat[offset:offset + s.numel()].reshape(s.shape).to(s.dtype))
            offset += s.numel()
        reduced = {}
        for n in names:
            size = torch.as_tensor(fields[n]).numel()
            value = flat[offset:offset + size].reshape(torch.as_tensor(fields[n]).shape)
            reduced[n] = value.to(torch.as_tensor(fields[n]).dtype)
            offset += size
        return out, reduced

    def maxima(self, sums, local, overwrites):
        """`sums` with each `overwrite_with_gradient` entry (`overwrites`) the
        elementwise maximum of the processes' `local` values instead of their sum
        (one all-reduce of those values)."""
        import torch.distributed as dist

        kept = [total for total, flag in zip(local, overwrites) if flag]
        flat = torch.cat([t.detach().reshape(-1).float() for t in kept])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        self.all_reduces += 1
        out, offset = [], 0
        for total, flag in zip(sums, overwrites):
            if flag:
                size = total.numel()
                total = flat[offset:offset + size].reshape(total.shape).to(total.dtype)
                offset += size
            out.append(total)
        return out

    def scalar(self, value):
        """A scalar summed over the processes (a weight budget's window weight)."""
        import torch.distributed as dist

        value = torch.as_tensor(value).detach().clone().float()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group)
        self.all_reduces += 1
        return value


class ShardedSums:
    """A window's sums as 1/W of them on each of the W processes of `reducer`'s group
    (`sums="sharded"`): the variables' sums flattened into one vector, padded to W
    equal shards, process r keeping shard r.

    Args:
        reducer: the `Reducer` of the group (it counts the collectives).
        shapes: the variables' shapes, in order.
    """

    def __init__(self, reducer: Reducer, shapes):
        import torch.distributed as dist

        self.reducer = reducer
        self.shapes = [tuple(shape) for shape in shapes]
        self.sizes = [int(torch.Size(shape).numel()) for shape in self.shapes]
        self.world = dist.get_world_size(reducer.group)
        total = sum(self.sizes)
        self.shard_size = -(-total // self.world)  # ceil

    def add(self, shard, gradients, factor, accept) -> None:
        """Adds the processes' micro-batch gradients (each times `factor`; zeros
        for a None one, or where this process's micro-batch is not `accept`ed) into
        this process's `shard`: one reduce-scatter, every process taking part."""
        import torch.distributed as dist

        flat = torch.zeros(self.shard_size * self.world, dtype=shard.dtype,
                           device=shard.device)
        if accept:
            offset = 0
            for gradient, size in zip(gradients, self.sizes):
                if gradient is not None:
                    part = torch.as_tensor(gradient).detach().reshape(-1).to(shard.dtype)
                    if factor is not None:
                        part = part * factor.to(device=part.device, dtype=part.dtype)
                    flat[offset:offset + size] = part
                offset += size
        received = torch.empty_like(shard)
        # (`reduce_scatter_single` from torch 2.13; `reduce_scatter_tensor` before.)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(received, flat, op=dist.ReduceOp.SUM, group=self.reducer.group)
        self.reducer.reduce_scatters += 1
        shard.add_(received)

    def gather(self, shard) -> list:
        """The whole sums, one tensor per variable: the shards gathered (one
        all-gather, every process taking part)."""
        import torch.distributed as dist

        flat = torch.empty(self.shard_size * self.world, dtype=shard.dtype,
                           device=shard.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(flat, shard.detach().contiguous(), group=self.reducer.group)
        self.reducer.all_gathers += 1
        out, offset = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(flat[offset:offset + size].reshape(shape))
            offset += size
        return out
