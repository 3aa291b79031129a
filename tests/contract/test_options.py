"""The options are declared once (`gradaccum.core.options.OPTIONS`): every door takes
each of them with its default, documents it with the table's words, and a saved
`AccumulatingModel` keeps them in its config (on each backend)."""

from __future__ import annotations

import inspect

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


@pytest.mark.parametrize("door, name", [
    (gradaccum.accumulate, "accumulate"),
    (gradaccum.wrap, "wrap"),
])
def test_a_name_that_is_no_option_is_refused_as_python_refuses_it(door, name):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword "
                                        r"argument 'stepz'$"):
        door(model, 2, stepz=4)
    with pytest.raises(TypeError, match="positional arguments but 3 were given"):
        door(model, 2, "exact")
    assert not hasattr(model, "_gradaccum_accumulation")


def test_the_options_are_typed_once_and_every_door_shows_them():
    # One TypedDict (the types) and OPTIONS (defaults, words) name the same options.
    assert tuple(declared.TYPES) == declared.NAMES
    for door in (gradaccum.accumulate, gradaccum.wrap, gradaccum.AccumulatingModel.__init__):
        parameters = inspect.signature(door).parameters
        assert {name: parameters[name].annotation for name in declared.NAMES} == (
            declared.TYPES), door
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="Unrecognized keyword arguments"):
        gradaccum.AccumulatingModel(model, steps=2, partal="drop")
