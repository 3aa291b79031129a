"""Realistic workloads: KerasHub tasks built from configs in code (no preset, nothing
downloaded), trained on preprocessed token arrays, for benchmarks/equal.py's realistic
grid.

- `gpt2_full`: `GPT2CausalLM` on a sized-down `GPT2Backbone` (4 layers, hidden 128,
  4 heads, intermediate 512, vocabulary 8192, sequence length 128): 1.86M weights in
  68 variables, all trained;
- `gpt2_lora`: the same task after `backbone.enable_lora(rank=4)`: 18,432 weights in
  24 variables trainable (the query and value projections' LoRA factors and their
  biases), every other weight frozen;
- `bert`: `BertTextClassifier` (2 classes) on a `BertBackbone` of the same shape
  (4 layers, hidden 128, 4 heads, intermediate 512, vocabulary 8192, sequence length
  128): 1.88M weights in 73 variables, all trained.

The size: one micro-batch of b = 8 through plain `fit` takes 0.1-0.4 s on the
project's 2-core CPU (measured, median of 5: TensorFlow gpt2_lora 0.24 s, gpt2_full
0.33 s, bert 0.14 s; JAX 0.20 / 0.28 / 0.13 s; PyTorch 0.29 / 0.37 / 0.25 s), so a
micro-batch's own work dominates the fixed cost of a step, as in real fine-tuning,
while the realistic grid (12 cells) stays at 15-20 minutes per backend. The width
suggested first (hidden 256, intermediate 1024) took 0.82 s a micro-batch on one
TensorFlow thread against 0.39 s at hidden 128, and would have doubled that; the
depth (4 blocks: the variables a real task has per block) and the vocabulary (8192:
the output layer and its tied embedding, the largest variable) were kept. Dropout
keeps KerasHub's default (0.1), and the tasks compile with their own default metrics
around the benchmark's loss and optimizer (GPT-2 a masked accuracy as weighted
metric, BERT an accuracy): what a user of these tasks trains.

Inputs are what the tasks' preprocessors would hand `fit`, random but seeded: token ids
with a padded tail (a third of the rows padded, id 0, after 50-100% of the sequence:
about 10% of the positions), the padding mask, for GPT-2 the next tokens as `y` and
the targets' padding mask as `sample_weight`, for BERT the segment ids (two halves)
and a label.

keras_hub is imported only when a task is built.
"""

from __future__ import annotations

import numpy as np

NAMES = ("gpt2_lora", "gpt2_full", "bert")
SEQUENCE_LENGTH = 128
CONFIG = {"vocabulary_size": 8192, "num_layers": 4, "num_heads": 4, "hidden_dim": 128,
          "intermediate_dim": 512, "max_sequence_length": SEQUENCE_LENGTH}


def build(name: str):
    """The task of workload `name`, uncompiled, its weights drawn from Keras's seed."""
    import keras_hub

    if name in ("gpt2_lora", "gpt2_full"):
        backbone = keras_hub.models.GPT2Backbone(**CONFIG)
        task = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        if name == "gpt2_lora":
            backbone.enable_lora(rank=4)
        return task
    if name == "bert":
        backbone = keras_hub.models.BertBackbone(**CONFIG)
        return keras_hub.models.BertTextClassifier(backbone, num_classes=2,
                                                   preprocessor=None)
    raise ValueError(f"unknown workload {name!r}")


def _tokens(rng, n: int):
    """Token ids and their padding mask: a third of the rows padded (id 0) after
    50-100% of the sequence."""
    ids = rng.integers(1, CONFIG["vocabulary_size"], (n, SEQUENCE_LENGTH + 1))
    lengths = np.where(rng.random(n) < 1 / 3,
                       rng.integers(SEQUENCE_LENGTH // 2, SEQUENCE_LENGTH + 1, n),
                       SEQUENCE_LENGTH + 1)
    mask = np.arange(SEQUENCE_LENGTH + 1) < lengths[:, None]
    return (ids * mask).astype("int32"), mask


def data(name: str, n: int, seed: int = 0) -> dict:
    """`fit`'s keyword arguments for n samples of workload `name`: `x` (a dict of token
    arrays), `y` and, for GPT-2, `sample_weight`."""
    rng = np.random.default_rng(seed)
    ids, mask = _tokens(rng, n)
    if name in ("gpt2_lora", "gpt2_full"):
        # As GPT2CausalLMPreprocessor: x the first 128 tokens, y the next ones,
        # sample_weight the targets' padding mask.
        return {"x": {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]},
                "y": ids[:, 1:], "sample_weight": mask[:, 1:].astype("float32")}
    if name == "bert":
        ids, mask = ids[:, :-1], mask[:, :-1]
        segments = (np.arange(SEQUENCE_LENGTH) >= SEQUENCE_LENGTH // 2) & mask
        return {"x": {"token_ids": ids, "segment_ids": segments.astype("int32"),
                      "padding_mask": mask},
                "y": rng.integers(0, 2, n)}
    raise ValueError(f"unknown workload {name!r}")
