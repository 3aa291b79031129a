"""The accelerator never waits for the host under accumulation, as in plain `fit`
(issue 54): Keras dispatches the batch ends asynchronously (where its backend can),
and the fit's own thread reads nothing back from the device between calls. Run by
each backend's process; the count of reads is JAX's (`_jax_reads`)."""

from __future__ import annotations

import threading

import keras
import pytest
from largebatch import SCE, data, mlp

import gradaccum


@pytest.fixture
def callback_lists(monkeypatch):
    """The CallbackLists Keras builds, as they are built."""
    made = []
    configure = keras.callbacks.CallbackList._configure_async_dispatch

    def recording(self, callbacks):
        configure(self, callbacks)
        made.append(self)

    monkeypatch.setattr(keras.callbacks.CallbackList, "_configure_async_dispatch", recording)
    return made


def _model(accumulating, **options):
    model = mlp(0)
    if accumulating:
        model = gradaccum.accumulate(model, steps=3, **options)
    model.compile(keras.optimizers.Adam(0.01), SCE)
    return model


@pytest.mark.parametrize("options", [{}, {"nonfinite": "raise"}])
def test_batch_ends_are_dispatched_as_plain_fits_are(callback_lists, options):
    x, y = data(48)
    _model(False).fit(x, y, batch_size=4, epochs=1, verbose=0)
    plain = callback_lists[-1]._async_train
    _model(True, **options).fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert callback_lists[-1]._async_train == plain
    # Keras's TensorFlow backend runs every callback in the fit's thread.
    assert plain == (keras.backend.backend() != "tensorflow")


def _jax_reads(monkeypatch):
    """Counts, by thread, the device-to-host reads of JAX arrays: Keras's
    (`convert_to_numpy`: its logs made Python numbers), a variable's, and an
    array's made a Python number or a NumPy array (on a CPU NumPy may read an
    array through its buffer, which nothing counts: the two above cover the paths
    of fit)."""
    import jax.numpy as jnp
    from keras.src import backend

    array = type(jnp.zeros(1))
    counts = {}

    def counted(original):
        def read(*args, **kwargs):
            thread = threading.get_ident()
            counts[thread] = counts.get(thread, 0) + 1
            return original(*args, **kwargs)

        return read

    monkeypatch.setattr(backend, "convert_to_numpy", counted(backend.convert_to_numpy))
    monkeypatch.setattr(keras.Variable, "numpy", counted(keras.Variable.numpy))
    monkeypatch.setattr(keras.Variable, "__array__", counted(keras.Variable.__array__))
    monkeypatch.setattr(array, "_value", property(counted(array._value.fget)))
    monkeypatch.setattr(array, "__array__", counted(array.__array__))
    monkeypatch.setattr(array, "_single_device_array_to_np_array_did_copy",
                        counted(array._single_device_array_to_np_array_did_copy))
    return counts


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="counts JAX's arrays")
@pytest.mark.parametrize("options", [{}, {"nonfinite": "raise"}, {"noise_scale": True}])
def test_the_fits_thread_reads_no_more_per_epoch_with_more_micro_batches(monkeypatch,
                                                                         options):
    # An epoch of 4 calls and one of 16 (12 and 48 micro-batches, windows of 3): the
    # fit's thread reads the same, at the epoch's ends only; the per-call logs
    # are read in Keras's worker thread.
    model = _model(True, **options)
    x, y = data(192)
    model.fit(x[:48], y[:48], batch_size=4, epochs=1, verbose=0)  # compiles
    counts = _jax_reads(monkeypatch)
    reads = []
    for n in (48, 192):
        counts.clear()
        model.fit(x[:n], y[:n], batch_size=4, epochs=1, verbose=0)
        reads.append(counts.get(threading.get_ident(), 0))
    assert reads[0] == reads[1]
    assert int(model.optimizer.iterations) == 4 + 4 + 16


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="counts JAX's compilations")
def test_a_fit_whose_data_ends_each_epoch_compiles_nothing_after_its_first():
    # A tf.data pipeline of unknown length: each epoch ends on the data's end, where
    # the open window (2 of 5 micro-batches) is flushed outside the step. Plain fit
    # compiles nothing after its first epoch; the flush's close is compiled once too.
    import jax
    import tensorflow as tf

    compiled = []

    def listen(event, duration, **kwargs):
        if "backend_compile" in event:
            compiled.append(event)

    class PerEpoch(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.counts = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = len(compiled)

        def on_epoch_end(self, epoch, logs=None):
            self.counts.append(len(compiled) - self.start)

    x, y = data(40)
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).filter(lambda a, b: True)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for accumulating in (False, True):
            epochs = PerEpoch()
            model = _model(accumulating)
            model.fit(unknown, epochs=4, verbose=0, callbacks=[epochs])
            assert epochs.counts[0] > 0 and epochs.counts[1:] == [0, 0, 0], (accumulating,
                                                                             epochs.counts)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert int(model.optimizer.iterations) == 4 * 2  # windows of 3: one full, one flushed
