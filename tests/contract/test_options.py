"""The options are declared once (`gradaccum.core.options.OPTIONS`): every door takes
each of them with its default, documents it with the table's words, and a saved
`AccumulatingModel` keeps them in its config (on each backend)."""

from __future__ import annotations

import keras
import pytest

import gradaccum
from gradaccum.core import options as declared


@pytest.mark.parametrize("door, skip", [
    (gradaccum.accumulate, 1),
    (gradaccum.wrap, 1),
    (gradaccum.AccumulatingModel.__init__, 2),
])
def test_every_door_takes_every_option_with_its_default(door, skip):
    declared.check_signature(door, skip=skip)


def test_a_door_that_drifts_from_the_table_is_named():
    def drifted(model, steps=None, *, weighting="uniform"):
        pass

    with pytest.raises(TypeError, match="drifted must take the options"):
        declared.check_signature(drifted)


@pytest.mark.parametrize("door", [gradaccum.accumulate, gradaccum.wrap])
def test_each_door_documents_each_option_with_the_tables_words(door):
    doc = " ".join(door.__doc__.split())
    for option in declared.OPTIONS:
        assert f"{option.name}: {' '.join(option.doc.split())}" in doc, option.name
    assert "{options}" not in door.__doc__


def test_a_saved_wrapper_keeps_every_option_in_its_config():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    trainer = gradaccum.wrap(model, steps=[(0, 1), (2, 3)], partial="drop",
                             nonfinite="apply", reduction="sum")
    config = trainer.get_config()
    for name in declared.NAMES:
        assert name in config, name
    assert config["steps"] == [[0, 1], [2, 3]] and config["partial"] == "drop"
    again = gradaccum.AccumulatingModel.from_config(config)
    assert again.steps == ((0, 1), (2, 3))
    assert (again.partial, again.nonfinite, again.reduction) == ("drop", "apply", "sum")
