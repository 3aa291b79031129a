"""The private Keras pieces gradaccum relies on still exist, with the parameters
gradaccum passes: a Keras upgrade that changes one fails here, in one place."""

from __future__ import annotations

import keras
import numpy as np

from gradaccum.backends.tensorflow import keras_compat as kc


def test_every_private_piece_exists_with_the_expected_parameters():
    assert kc.missing_pieces() == []


def test_the_check_names_a_missing_or_changed_piece(monkeypatch):
    class Owner:
        def renamed(self, a, b):
            pass

    monkeypatch.setattr(
        kc, "PRIVATE_PIECES", ((Owner, "gone", ()), (Owner, "renamed", ("a", "c")))
    )
    assert kc.missing_pieces() == [
        "Owner.gone is missing",
        "Owner.renamed takes ['a', 'b'], gradaccum passes ['a', 'c']",
    ]


def test_instance_attributes_read_from_live_objects():
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=["mse"])
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    assert kc.call_has_training_arg(model) is True
    assert isinstance(kc.loss_tracker(model), keras.metrics.Mean)
    assert kc.count_compiled_losses(kc.compiled_loss(model)) == 1
    bn = model.layers[0]
    assert list(kc.batch_norm_reduction_axes(bn)) == [0]
    assert [v.name for v in kc.own_variables(bn)] == [
        "gamma", "beta", "moving_mean", "moving_variance"
    ]
    assert kc.flatten_layers(model)[0] is model
