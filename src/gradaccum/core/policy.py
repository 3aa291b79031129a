"""The settings the state machine follows (`Policy`), from the checked options: when
a window is due, the reduction, the non-finite policy, what the end of the data does,
and how a micro-batch is weighed."""

from __future__ import annotations


class Policy:
    """The settings the transitions follow, from the checked options.

    Args:
        rule: the `WindowRule` (when a window is due).
        reduction: `"mean"` or `"sum"`.
        nonfinite: a policy name or the user's callable.
        partial: what the end of the data does to an open window (`"flush"`,
            `"carry"`, `"drop"`); None where nothing ends the data (a custom loop).
        weighting: `"exact"`, `"uniform"` or a callable; None where the caller
            passes weights (a custom loop).
    """

    def __init__(self, rule, reduction="mean", nonfinite="skip", partial=None,
                 weighting=None):
        self.rule = rule
        self.reduction = reduction
        self.nonfinite = nonfinite
        self.partial = partial
        self.weighting = weighting

    @property
    def mean(self) -> bool:
        return self.reduction == "mean"

    @property
    def raises(self) -> bool:
        """Whether a step can meet an error (`fail`): the non-finite policy
        "raise", a weighting or schedule callable."""
        return (self.nonfinite == "raise" or callable(self.weighting)
                or callable(self.rule.steps))
