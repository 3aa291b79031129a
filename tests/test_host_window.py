"""`gradaccum.core.host_window`: which micro-batch may close its window, counted on
the host (the JAX step without the close runs the others: issue 54). Each case is
the device's rule (`transitions.decide`) counted by hand."""

from __future__ import annotations

import pytest

from gradaccum.core.host_window import HostWindow
from gradaccum.core.window import WindowRule


def _closes(window, n):
    return [i + 1 for i in range(n) if window.may_close()]


@pytest.mark.parametrize("partial, expected", [
    ("flush", [3, 6, 7]),
    ("drop", [3, 6, 7]),
    ("carry", [3, 6]),
])
def test_a_window_closes_at_its_length_and_as_partial_says_at_the_epochs_end(partial,
                                                                             expected):
    window = HostWindow(WindowRule(steps=3), partial)
    window.start(length=0, epoch_length=7, resume_skip=0)
    assert _closes(window, 7) == expected
    assert window.length == (1 if partial == "carry" else 0)


def test_a_window_carried_into_the_epoch_closes_sooner():
    window = HostWindow(WindowRule(steps=4), "carry")
    window.start(length=3, epoch_length=9, resume_skip=0)
    assert _closes(window, 9) == [1, 5, 9]


def test_data_of_unknown_length_closes_only_full_windows():
    # The data's end closes the last window outside the step (`closed`).
    window = HostWindow(WindowRule(steps=2), "flush")
    window.start(length=0, epoch_length=-1, resume_skip=0)
    assert _closes(window, 5) == [2, 4]
    window.closed()
    assert window.length == 0


def test_restored_micro_batches_are_passed_over_and_count_in_the_epoch():
    # BackupAndRestore restored 3 micro-batches into an epoch of 8, inside a window
    # of 2 of 4: the step holds the state for the first 3; the epoch's end (8th)
    # flushes.
    window = HostWindow(WindowRule(steps=4), "flush")
    window.start(length=2, epoch_length=8, resume_skip=3)
    assert _closes(window, 8) == [5, 8]


def test_an_unknown_position_lets_every_micro_batch_close():
    window = HostWindow(WindowRule(steps=3), "flush")
    assert not window.known
    assert _closes(window, 4) == [1, 2, 3, 4]
    window.start(length=0, epoch_length=None, resume_skip=0)
    assert _closes(window, 3) == [3]
    window.forget()
    assert _closes(window, 2) == [1, 2]


@pytest.mark.parametrize("rule, follows", [
    (WindowRule(steps=4), True),
    (WindowRule(steps=1), False),
    (WindowRule(steps=[(0, 2), (10, 4)]), False),
    (WindowRule(weight_per_update=64.0), False),
])
def test_only_a_fixed_length_of_several_is_counted(rule, follows):
    assert HostWindow.follows(rule) is follows
