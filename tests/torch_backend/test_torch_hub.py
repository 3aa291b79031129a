"""KerasHub tasks fine-tuned on strings through their own `fit` on PyTorch, with
LoRA: exact against the task trained on the windows (KerasHub's preprocessing runs
in tf.data, the task's step on torch)."""

from __future__ import annotations

import keras
import numpy as np
import torch
from largebatch import assert_weights_close

import gradaccum
import hub_models
from hub_lora_cases import (  # noqa: F401 (collected here, in this backend's process)
    test_bert_classifier_lora_on_strings_equals_the_task_trained_on_the_windows,
    test_gpt2_lora_on_strings_equals_the_task_trained_on_the_windows,
    test_gpt2_lora_split_into_micro_batches_equals_the_task_on_the_whole_batch,
)


def test_gpt2_lora_trains_privately_on_strings():
    """gradaccum.Privacy on a KerasHub GPT-2 with LoRA, strings in: each text's
    gradient (its masked token loss) clipped; equal to the reference clipping text by
    text on the preprocessed batch."""
    texts = hub_models.make_texts()
    clip = 0.03
    task = hub_models.make_task(seed=0, optimizer=keras.optimizers.SGD(0.5))
    task.backbone.enable_lora(rank=4)
    reference = hub_models.make_task(seed=0, optimizer=keras.optimizers.SGD(0.5))
    reference.backbone.enable_lora(rank=4)
    reference.set_weights(task.get_weights())
    gradaccum.accumulate(task, steps=3, privacy=gradaccum.Privacy(clip, 0.0))
    history = task.fit(texts, batch_size=4, shuffle=False, verbose=0)
    assert history.history["updates"] == [2.0]

    x, y, sample_weight = reference.preprocessor(texts)
    x = {k: np.asarray(v) for k, v in x.items()}
    y, sample_weight = np.asarray(y), np.asarray(sample_weight)
    variables = reference.trainable_variables
    clipped = 0
    for start in (0, 12):
        total = [np.zeros(v.shape, "float32") for v in variables]
        for i in range(start, start + 12):
            example = {k: v[i:i + 1] for k, v in x.items()}
            for variable in variables:  # (zero_grad misses LoRA's, see step.py)
                variable.value.grad = None
            loss = reference._compile_loss(torch.as_tensor(y[i:i + 1]),
                                           reference(example, training=True),
                                           torch.as_tensor(sample_weight[i:i + 1]))
            loss.backward()
            grads = [v.value.grad.numpy().copy() for v in variables]
            norm = float(np.sqrt(sum(float(np.sum(np.square(g))) for g in grads)))
            clipped += norm > clip
            total = [t + g * (clip / max(norm, clip)) for t, g in zip(total, grads)]
        with torch.no_grad():
            reference.optimizer.apply([torch.as_tensor(t / 12) for t in total], variables)
    assert clipped >= 12  # clipping acted
    assert_weights_close(task, reference, atol=1e-6)
