"""gradaccum.accumulate on a KerasHub task (GPT2CausalLM with its preprocessor, LoRA)
against the task trained on the concatenated windows (issue 14)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
import hub_models
from gradaccum.attach import accumulation_of
from test_keras_model import assert_weights_close, max_gap


@pytest.fixture(scope="module")
def trained_24():
    """The task accumulated over 24 strings: 6 micro-batches of 4, windows 12 + 12."""
    keras.utils.clear_session()
    texts = hub_models.make_texts()
    task = gradaccum.accumulate(hub_models.make_task(seed=0), steps=3)
    history = task.fit(texts, batch_size=4, shuffle=False, verbose=0)
    reference = hub_models.reference_fit_on_windows(hub_models.make_task(seed=0), texts, [12, 12])
    return task, reference, history


def test_gpt2_task_equals_the_task_trained_on_the_windows(trained_24):
    task, reference, history = trained_24
    assert type(task) is hub_models.keras_hub.models.GPT2CausalLM
    assert max_gap(task, hub_models.make_task(seed=0)) > 1e-3
    assert_weights_close(task, reference, rtol=1e-5)
    assert int(task.optimizer.iterations) == int(reference.optimizer.iterations) == 2
    assert history.history["updates"] == [2.0]


def test_gpt2_task_with_a_partial_last_window():
    texts = hub_models.make_texts()[:20]  # 5 micro-batches of 4: windows 12 + 8
    # SGD, not Adam: Adam's first updates hardly depend on the gradient's scale, so
    # they would not show a partial window scaled by r/k.
    task = hub_models.make_task(seed=0, optimizer=keras.optimizers.SGD(1.0))
    gradaccum.accumulate(task, steps=3)
    history = task.fit(texts, batch_size=4, shuffle=False, verbose=0)
    reference = hub_models.reference_fit_on_windows(
        hub_models.make_task(seed=0), texts, [12, 8], optimizer=keras.optimizers.SGD(1.0)
    )
    assert max_gap(task, hub_models.make_task(seed=0)) > 1e-3
    assert_weights_close(task, reference, rtol=1e-5)
    assert int(task.optimizer.iterations) == 2
    assert history.history["updates"] == [2.0]


def test_gpt2_task_on_a_repeated_dataset_trains_the_micro_batches_steps_per_epoch_asks():
    # The usual pipeline: strings batched by 4 and repeated forever; an epoch is 5
    # micro-batches (steps_per_epoch), windows of 3: per epoch 12 + 8 strings, the
    # second epoch going on from the 21st string of the stream.
    texts = hub_models.make_texts()[:20]
    task = gradaccum.accumulate(hub_models.make_task(seed=0), steps=3)
    # Compiled again under accumulation: three micro-batches per call, gradaccum's
    # default (a task compiled before keeps its own).
    hub_models.compile_task(task, keras.optimizers.SGD(1.0))
    assert task.steps_per_execution == 3
    dataset = tf.data.Dataset.from_tensor_slices(texts).batch(4).repeat()
    history = task.fit(dataset, epochs=2, steps_per_epoch=5, verbose=0)
    reference = hub_models.reference_fit_on_windows(
        hub_models.make_task(seed=0), texts, [12, 8], epochs=2,
        optimizer=keras.optimizers.SGD(1.0),
    )
    assert max_gap(task, hub_models.make_task(seed=0)) > 1e-3
    assert_weights_close(task, reference, rtol=1e-5)
    assert history.history["updates"] == [2.0, 4.0]


def test_gpt2_task_generates_and_saves_as_plain_keras_hub(trained_24, tmp_path):
    task, reference, _ = trained_24
    generated = task.generate("the", max_length=8)
    assert isinstance(generated, str) and generated.startswith("the")
    assert generated == reference.generate("the", max_length=8)

    path = tmp_path / "task.keras"
    task.save(path)
    with zipfile.ZipFile(path) as archive:
        assert "gradaccum" not in archive.read("config.json").decode()
    x, _, _ = task.preprocessor(hub_models.make_texts()[:4])
    inputs = {key: keras.ops.convert_to_numpy(value) for key, value in x.items()}
    expected = keras.ops.convert_to_numpy(task(inputs))
    np.savez(tmp_path / "x.npz", **inputs)
    code = (
        "import sys; sys.modules['gradaccum'] = None\n"
        "import keras, keras_hub, numpy as np\n"
        f"m = keras.saving.load_model({str(path)!r})\n"
        f"x = dict(np.load({str(tmp_path / 'x.npz')!r}))\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, keras.ops.convert_to_numpy(m(x)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), expected, rtol=1e-5, atol=1e-6)


def windows_dataset(texts, sizes):
    starts = np.cumsum([0, *sizes])
    dataset = None
    for start, stop in zip(starts[:-1], starts[1:]):
        window = tf.data.Dataset.from_tensor_slices(texts[start:stop]).batch(stop - start)
        dataset = window if dataset is None else dataset.concatenate(window)
    return dataset


def test_gpt2_lora_accumulates_only_the_lora_parameters():
    texts = hub_models.make_texts()
    task = hub_models.make_task(seed=0)
    task.backbone.enable_lora(rank=4)
    reference = hub_models.make_task(seed=0)
    reference.backbone.enable_lora(rank=4)
    reference.set_weights(task.get_weights())  # the same LoRA initial factors
    trainable = sum(int(np.prod(v.shape)) for v in task.trainable_variables)
    assert trainable == 352  # hub_models: 4 LoRA factors (320) and 2 biases (32)

    initial = task.get_weights()
    gradaccum.accumulate(task, steps=3)
    task.fit(texts, batch_size=4, shuffle=False, verbose=0)
    accumulators = accumulation_of(task).state.accumulators()
    assert len(accumulators) == 1
    accumulated = sum(
        int(np.prod(v.shape)) for acc in accumulators for v in acc.accumulators
    )
    assert accumulated == trainable

    reference.fit(windows_dataset(texts, [12, 12]), shuffle=False, verbose=0)
    assert int(task.optimizer.iterations) == int(reference.optimizer.iterations) == 2
    moved = [float(np.abs(a - b).max()) for a, b in zip(initial, task.get_weights())]
    assert sum(m > 0 for m in moved) == len(task.trainable_variables)  # LoRA only
    assert_weights_close(task, reference, rtol=1e-5)


def test_gpt2_task_on_two_replicas_equals_the_task_trained_on_the_windows():
    """MirroredStrategy over 2 CPUs, strings in: each replica takes 2 of every 4
    strings; the task equals one device fitting the windows of 12 (Keras's own
    first-batch build fails on the boolean padding mask; gradaccum builds from one
    replica's batch)."""
    from test_distribute import mirrored

    keras.utils.clear_session()
    texts = hub_models.make_texts()
    reference = hub_models.reference_fit_on_windows(hub_models.make_task(seed=0), texts, [12, 12])
    with mirrored().scope():
        task = gradaccum.accumulate(hub_models.make_task(seed=0), steps=3)
    history = task.fit(texts, batch_size=4, shuffle=False, verbose=0)
    assert history.history["updates"] == [2.0]
    assert int(task.optimizer.iterations.numpy()) == 2
    assert_weights_close(task, reference)


def test_gpt2_task_with_a_token_budget_and_a_per_token_loss():
    """weight_per_update=50 with a per-token loss: each update holds the first run of
    micro-batches whose target tokens reach 50 (windows of 4, 3 and 4 micro-batches of
    2 strings, then a partial 1), and equals the task fitted on those windows."""
    from test_schedules import budget_windows

    def per_token():
        return keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        )

    texts = hub_models.make_texts()
    task = hub_models.make_task(seed=0, loss=per_token())
    tokens = hub_models.token_counts(task, texts)
    counts = [int(tokens[i:i + 2].sum()) for i in range(0, len(texts), 2)]  # batches of 2
    windows = budget_windows(counts, 50)
    assert [len(w) for w in windows] == [4, 3, 4, 1]
    gradaccum.accumulate(task, weight_per_update=50)
    updates = []
    watch = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: updates.append(
            (logs["updates"], logs["window_micro_batches"], logs["window_weight"])
        )
    )
    history = task.fit(texts, batch_size=2, shuffle=False, verbose=0, callbacks=[watch])
    reference = hub_models.reference_fit_on_windows(
        hub_models.make_task(seed=0), texts, [2 * len(w) for w in windows], loss=per_token()
    )
    full = [w for w in windows if sum(counts[i] for i in w) >= 50]
    closing = [updates[w[-1]] for w in full]
    assert closing == [
        (float(n + 1), float(len(w)), float(sum(counts[i] for i in w)))
        for n, w in enumerate(full)
    ]
    assert history.history["updates"] == [float(len(windows))]
    assert int(task.optimizer.iterations) == int(reference.optimizer.iterations)
    assert max_gap(task, hub_models.make_task(seed=0)) > 1e-3
    assert_weights_close(task, reference, rtol=1e-5)


def test_gpt2_task_on_strings_split_inside_the_step():
    """KerasHub: the task's own fit preprocesses 24 strings in batches of 8; each
    batch is split 3 + 3 + 2 inside the step; equal to the task fitted at 8."""
    texts = hub_models.make_texts()
    task = gradaccum.accumulate(hub_models.make_task(seed=0), micro_batch_size=3)
    history = task.fit(texts, batch_size=8, shuffle=False, verbose=0)
    reference = hub_models.reference_fit_on_windows(hub_models.make_task(seed=0), texts, [8, 8, 8])
    assert max_gap(task, hub_models.make_task(seed=0)) > 1e-3
    assert_weights_close(task, reference, rtol=1e-5)
    assert int(task.optimizer.iterations) == 3
    assert history.history["updates"] == [3.0]
