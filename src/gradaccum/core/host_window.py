"""Which micro-batch closes its window, known on the host before it runs.

A window of a fixed length (`steps=k`) closes at its k-th micro-batch, skipped ones
included, or at the epoch's last micro-batch where `partial` closes windows there
(`gradaccum.core.window`): the position in the window and in the epoch is all it
takes, and the host can count both without reading anything back. A backend whose
compiled step pays for the possibility of a close at every micro-batch (a
conditional update and the sums emptied under a mask, per micro-batch) then runs a
step without the close wherever none can happen, and the whole step only at the
micro-batches that may close (JAX: `gradaccum.backends.jax.phases`).

`HostWindow` is that count. It knows the position only from the state it was
started from (read when an epoch begins) and the micro-batches it has seen since;
outside an epoch, or with a rule whose windows close on values (a weight budget, a
schedule read at an update index that skipped windows do not advance), it knows
nothing, and every micro-batch may close. `decide` in `gradaccum.core.transitions`
stays the rule the step applies: a micro-batch this count says closes runs the
whole step, which decides on the device as always; the step without the close
records an error where a window was due all the same (`transitions.unclosed`).
"""

from __future__ import annotations

from gradaccum.core.window import WindowRule


class HostWindow:
    """The open window's length and the epoch's position, counted on the host.

    Args:
        rule: the checked window rule (`WindowRule`); counted only when its length
            is a constant (`follows`).
        partial: the `partial` option: `"flush"` and `"drop"` close a window at the
            epoch's last micro-batch, `"carry"` keeps it open.

    Example:

        >>> from gradaccum.core.window import WindowRule
        >>> window = HostWindow(WindowRule(steps=3), "flush")
        >>> window.start(length=0, epoch_length=5, resume_skip=0)
        >>> [window.may_close() for _ in range(5)]
        [False, False, True, False, True]
    """

    def __init__(self, rule: WindowRule, partial: str):
        self.steps = rule.constant
        self.closes_at_end = partial in ("flush", "drop")
        self.length: int | None = None
        self.epoch_step = 0
        self.epoch_length = -1
        self.resume_skip = 0

    @staticmethod
    def follows(rule: WindowRule) -> bool:
        """Whether the host can count `rule`'s windows: a constant length of more
        than one micro-batch (a window of one closes at each)."""
        return rule.constant is not None and rule.constant > 1

    @property
    def known(self) -> bool:
        return self.length is not None

    def start(self, length: int, epoch_length: int | None, resume_skip: int) -> None:
        """Counts from the state as an epoch begins: the open window's length
        (skipped micro-batches included), the epoch's length (-1 or None: unknown)
        and the micro-batches a restored run skips first."""
        self.length = int(length)
        self.epoch_step = 0
        self.epoch_length = -1 if epoch_length is None else int(epoch_length)
        self.resume_skip = int(resume_skip)

    def forget(self) -> None:
        """Outside an epoch (the fit ended, however): every micro-batch may close."""
        self.length = None

    def may_close(self) -> bool:
        """Counts the next micro-batch: whether its window may close with it
        (always True while the position is unknown)."""
        if self.length is None:
            return True
        self.epoch_step += 1
        if self.resume_skip > 0:
            # Trained on before a restore: the step holds the state as it was.
            self.resume_skip -= 1
            return False
        self.length += 1
        end = 0 < self.epoch_length <= self.epoch_step
        assert self.steps is not None, "counted only for a constant length (follows)"
        if self.length >= self.steps or (end and self.closes_at_end):
            self.length = 0
            return True
        return False

    def closed(self) -> None:
        """The open window was closed outside the step (the data's end)."""
        if self.length is not None:
            self.length = 0
