"""KerasHub tasks fine-tuned on strings through their own `fit`, with LoRA, exact
against the task trained on the windows, on any backend: imported by
tests/jax_backend/test_jax_hub.py and tests/torch_backend/test_torch_hub.py (each
adds its privacy case, whose per-example reference is the backend's own)."""

from __future__ import annotations

import keras
import numpy as np
from largebatch import assert_weights_close, max_gap

import gradaccum
import hub_models


def test_gpt2_lora_on_strings_equals_the_task_trained_on_the_windows():
    texts = hub_models.make_texts()[:20]  # 5 micro-batches of 4: windows 12 + 8
    task = hub_models.make_task(seed=0)
    task.backbone.enable_lora(rank=4)
    reference = hub_models.make_task(seed=0)
    reference.backbone.enable_lora(rank=4)
    reference.set_weights(task.get_weights())  # the same LoRA initial factors
    initial = hub_models.make_task(seed=0)
    initial.backbone.enable_lora(rank=4)
    initial.set_weights(task.get_weights())

    gradaccum.accumulate(task, steps=3)
    history = task.fit(texts, batch_size=4, shuffle=False, verbose=0)
    for start, stop in [(0, 12), (12, 20)]:
        reference.fit(texts[start:stop], batch_size=stop - start, shuffle=False, verbose=0)
    assert int(task.optimizer.iterations) == int(reference.optimizer.iterations) == 2
    assert history.history["updates"] == [2.0]
    assert max_gap(task, initial) > 1e-4
    assert_weights_close(task, reference, rtol=1e-5, atol=1e-6)
    # Only the LoRA factors and the biases left trainable moved.
    moved = [float(np.abs(a - b).max()) for a, b in zip(initial.get_weights(), task.get_weights())]
    assert sum(m > 0 for m in moved) == len(task.trainable_variables)


def _bert_classifier(seed: int = 0):
    import keras_hub  # when called: collecting this module imports no KerasHub

    words = sorted({w.strip(".") for t in hub_models.make_texts() for w in t.split()})
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *words]
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=16)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(vocabulary), num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16, dropout=0.0,
    )
    task = keras_hub.models.BertTextClassifier(
        backbone, num_classes=3, preprocessor=preprocessor, dropout=0.0
    )
    rng = np.random.default_rng(seed)
    task.set_weights([rng.normal(0, 0.2, w.shape).astype(w.dtype) for w in task.get_weights()])
    task.backbone.enable_lora(rank=2)
    rng = np.random.default_rng(seed + 1)
    task.set_weights([rng.normal(0, 0.2, w.shape).astype(w.dtype) for w in task.get_weights()])
    task.compile(optimizer=keras.optimizers.Adam(1e-2))
    return task


def test_bert_classifier_lora_on_strings_equals_the_task_trained_on_the_windows():
    texts = np.array(hub_models.make_texts())  # 24 strings: micro-batches 5,5,5,5,4
    labels = np.arange(24) % 3
    task = gradaccum.accumulate(_bert_classifier(), steps=2)
    history = task.fit(texts, labels, batch_size=5, epochs=1, shuffle=False, verbose=0)
    reference = _bert_classifier()
    for start, stop in [(0, 10), (10, 20), (20, 24)]:
        reference.fit(texts[start:stop], labels[start:stop], batch_size=stop - start,
                      shuffle=False, verbose=0)
    assert history.history["updates"] == [3.0]
    assert max_gap(task, _bert_classifier()) > 1e-4
    assert_weights_close(task, reference, rtol=1e-5, atol=1e-6)


def test_gpt2_lora_split_into_micro_batches_equals_the_task_on_the_whole_batch():
    # Batches of 12 strings as 5 + 5 + 2 token-masked micro-batches: one update per
    # batch, equal to the task's own fit on the batches.
    texts = hub_models.make_texts()[:24]
    task = hub_models.make_task(seed=0)
    task.backbone.enable_lora(rank=4)
    reference = hub_models.make_task(seed=0)
    reference.backbone.enable_lora(rank=4)
    reference.set_weights(task.get_weights())
    initial = [w.copy() for w in task.get_weights()]

    gradaccum.accumulate(task, micro_batch_size=5)
    history = task.fit(texts, batch_size=12, shuffle=False, verbose=0)
    expected = reference.fit(texts, batch_size=12, shuffle=False, verbose=0)
    assert int(task.optimizer.iterations) == int(reference.optimizer.iterations) == 2
    assert history.history["window_micro_batches"] == [3.0]
    assert max(float(np.abs(a - b).max()) for a, b in zip(initial, task.get_weights())) > 1e-4
    assert_weights_close(task, reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
