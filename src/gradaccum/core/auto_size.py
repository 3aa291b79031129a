"""Which micro-batch size split mode's `micro_batch_size="auto"` tries next: the
search both backends share (a pure record of the sizes that ran and failed)."""

from __future__ import annotations


class AutoSize:
    """Which micro-batch size `micro_batch_size="auto"` tries next.

    It starts from the whole batch (or `cap`). A size that runs out of memory is
    halved until one runs; later batches probe between the largest size that ran
    and the smallest that did not (one probe per batch, each batch still trained
    once), so the search settles on the largest size that runs.

    Args:
        cap: the largest micro-batch to try, or None for the whole batch.
    """

    def __init__(self, cap: int | None = None):
        self.cap = cap
        # Every size tried is a multiple of this (the devices a batch is sharded
        # over, each taking an equal part of every micro-batch).
        self.granule = 1
        self.fits: int | None = None
        self.fails: int | None = None
        self.failures: list[int] = []

    def size_for(self, batch: int) -> int:
        """The micro-batch size to try on a batch of `batch` samples."""
        top = batch if self.cap is None else min(self.cap, batch)
        top = max(1, top)
        if self.fails is None:
            size = top
        elif self.fits is None:
            size = min(top, (self.fails + 1) // 2)
        elif self.fails - self.fits > self.granule:
            size = min(top, (self.fits + self.fails) // 2)
        else:
            size = min(top, self.fits)
        granule = self.granule
        return max(granule, size // granule * granule)

    def failed(self, size: int) -> None:
        """`size` ran out of memory."""
        self.failures.append(size)
        self.fails = size if self.fails is None else min(self.fails, size)
        if self.fits is not None and self.fits >= self.fails:
            # A size that ran before does not any more (memory is taken elsewhere):
            # search down again.
            self.fits = None

    def ran(self, size: int) -> None:
        """`size` (the largest micro-batch of a batch) ran."""
        if self.fails is not None and size >= self.fails:
            self.fails = None
        self.fits = size if self.fits is None else max(self.fits, size)

    @property
    def settled(self) -> bool:
        """Whether the search is over: no size failed, or the largest size that ran
        is one below the smallest that failed."""
        return self.fits is not None and (
            self.fails is None or self.fails - self.fits <= self.granule
        )

    @property
    def chosen(self) -> int | None:
        """The size in use: the largest that ran (None before a batch ran)."""
        return self.fits
