"""`torch.distributed` for a `GradientAccumulator`: one all-reduce per update.

Each process accumulates its own micro-batches (a model in
`DistributedDataParallel` runs their backward passes under `no_sync`, so DDP
communicates nothing); when a window closes, its sums, total weight and received
counts travel in one flat buffer through one `all_reduce` (a sum), and every process
applies `G = sum_r S_r / sum_r W_r`: the update of one process training on the
global window, the processes weighed by their loss normalizers (DDP averages them
instead, which is exact only for equal shares). A weight budget compares the global
window's weight: one scalar all-reduce per micro-batch.
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

    def window(self, sums, fields):
        """`(sums, fields)` summed over the processes, in one all-reduce of one
        float buffer (the sums in their dtype's float32 or float64)."""
        import torch.distributed as dist

        dtype = torch.float64 if any(s.dtype == torch.float64 for s in sums) else torch.float32
        names = sorted(fields)
        parts = [s.detach().reshape(-1).to(dtype) for s in sums]
        parts += [torch.as_tensor(fields[n]).reshape(-1).to(device=parts[0].device,
                                                             dtype=dtype) for n in names]
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
