"""A tiny KerasHub GPT-2 task, built offline and deterministically, for the tests.

Nothing here downloads: the byte-level BPE vocabulary and merges are learned from the
test strings themselves, and the weights are drawn from a NumPy generator by seed.
The task keeps KerasHub's own training path: `GPT2CausalLM.fit` on raw strings batches
them with `tf.data`, maps `GPT2CausalLMPreprocessor` over each batch (in
`PipelineModel.fit`) and hands `(x, y, sample_weight)` to Keras's `train_step`, where
`sample_weight` is the padding mask of the targets. The compiled loss is
`SparseCategoricalCrossentropy(from_logits=True)` with the default reduction
`sum_over_batch_size`: the sum of the masked token losses divided by batch x
`sequence_length`, padded positions included (see `token_counts`).

Two facts worth knowing, checked on keras-hub 0.32 / Keras 3.15:
`keras.saving.load_model` restores the weights and the vocabulary but not the compile
arguments (the task is compiled anew with KerasHub's defaults: call `compile_task`), and
`task.backbone.enable_lora(rank=4)` leaves 6 trainable variables, 352 values: the 4
LoRA factors (320 values) and the biases of the 2 query/value layers it targets (32).

Test modules import it as `import hub_models` (tests/ is on `sys.path`). keras-hub comes
with the README's test install (the `hub` extra) on Python >= 3.11: there, importing this
module without it fails, so a broken install cannot pass by skipping; on Python 3.10,
where the extra installs nothing, it skips the importing module. It holds no tests.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections import Counter
from collections.abc import Sequence

import keras
import numpy as np
import pytest

if importlib.util.find_spec("keras_hub") is None:
    if sys.version_info >= (3, 11):
        raise ImportError("keras_hub is missing: the README's test install provides it")
    pytest.skip("the `hub` extra installs nothing before Python 3.11", allow_module_level=True)


def __getattr__(name: str):
    """`hub_models.keras_hub`, imported when first asked for. The functions below
    import KerasHub (and TensorFlow) when called, not at import: a worker that runs
    no KerasHub test (the fast tier on JAX and PyTorch) saves about 3 s at its start."""
    if name == "keras_hub":
        return importlib.import_module("keras_hub")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

SEQUENCE_LENGTH = 16
END_TOKEN = "<|endoftext|>"

_TEXTS = (
    "the cat sat.",
    "a dog ran to the park and back home.",
    "the sun is warm.",
    "birds sing in the morning when the sky is clear.",
    "we read a book.",
    "rain fell on the roof all night.",
    "the tea is hot.",
    "she walks her dog by the river every day.",
    "fish swim.",
    "the old man sat on a bench and fed the birds.",
    "a red car went by.",
    "the children played in the garden until dark.",
    "snow is cold.",
    "the wind moved the trees and the leaves fell.",
    "he sang a song.",
    "the moon rose over the hills.",
    "we ate bread and cheese for lunch.",
    "the river is long.",
    "a small boat sailed across the lake at dawn.",
    "cats sleep a lot.",
    "the baker made fresh bread.",
    "the train was late again.",
    "stars shine at night over the quiet town.",
    "the end.",
)

# GPT-2's pre-tokenization (BytePairTokenizer's SPLIT_PATTERN_1) for ASCII text.
_WORD = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")


def make_texts() -> list[str]:
    """The 24 training strings: 2 to 11 words, so each pads to its own mask.

    Returns:
        A new list of ASCII strings. With `make_vocabulary()` each has 4 to 13
        unmasked targets of the 16 positions of `SEQUENCE_LENGTH`: none is truncated.
    """
    return list(_TEXTS)


def make_vocabulary(
    texts: Sequence[str] | None = None, *, num_merges: int | None = None
) -> tuple[dict[str, int], list[str]]:
    """A byte-level BPE vocabulary and merges learned from `texts`, deterministically.

    GPT-2's byte-to-unicode map leaves printable ASCII as it is and writes a space as
    "Ġ", so the base symbols are the texts' characters with " " read as "Ġ". Merges
    join the most frequent adjacent pair (ties: the smallest pair), `num_merges` times.

    Args:
        texts: ASCII strings; defaults to `make_texts()`.
        num_merges: how many merges to learn; `None` (default) merges until every
            word is one token (257 tokens for `make_texts()`: each text is then 3 to 12
            tokens, and 4 to 13 unmasked targets of the 16 positions).

    Returns:
        `(vocabulary, merges)`: `{token: id}` with `"<|endoftext|>"` at id 0 (GPT-2's
        start, end and padding token), and merge rules as `"left right"` strings.

    Raises:
        ValueError: a text is not printable ASCII.
    """
    texts = make_texts() if texts is None else list(texts)
    for text in texts:
        if not (text.isascii() and text.isprintable()):
            raise ValueError(f"`texts` must be printable ASCII. Received: text={text!r}")
    words = Counter(tuple(word.replace(" ", "Ġ")) for text in texts for word in _WORD.findall(text))
    symbols = sorted({s for word in words for s in word})
    merges = []
    while num_merges is None or len(merges) < num_merges:
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word[:-1], word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    tokens = [END_TOKEN, *symbols, *(left + right for left, right in merges)]
    return {token: i for i, token in enumerate(tokens)}, [f"{a} {b}" for a, b in merges]


def make_preprocessor(sequence_length: int = SEQUENCE_LENGTH):
    """`GPT2CausalLMPreprocessor` over a `GPT2Tokenizer` of `make_vocabulary()`.

    Args:
        sequence_length: positions per sample; each text becomes
            `<|endoftext|> tokens <|endoftext|>`, padded with id 0 or truncated.

    Returns:
        The preprocessor: strings -> `({"token_ids", "padding_mask"}, labels,
        sample_weight)`, labels shifted by one, sample_weight the labels' padding mask.
    """
    import keras_hub

    vocabulary, merges = make_vocabulary()
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    return keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=sequence_length)


def make_backbone(vocabulary_size: int, *, seed: int = 0, sequence_length: int = SEQUENCE_LENGTH):
    """A 1-layer GPT-2 backbone (hidden 16) whose weights depend only on `seed`: the
    smallest that has every kind of layer a GPT-2 trains (the suite's time).

    Args:
        vocabulary_size: rows of the token embedding.
        seed: seeds the NumPy generator that draws every random weight.
        sequence_length: `max_sequence_length` of the position embedding.

    Returns:
        A built `keras_hub.models.GPT2Backbone` without dropout.
    """
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary_size,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=sequence_length,
        dropout=0.0,
    )
    # GPT-2's initializers are unseeded; redraw what they drew at its scale (N(0, 0.02))
    # and keep the constant ones (biases 0, layer-norm scales 1).
    rng = np.random.default_rng(seed)
    weights = backbone.get_weights()
    backbone.set_weights(
        [
            w if np.all(w == w.flat[0]) else rng.normal(0.0, 0.02, w.shape).astype(w.dtype)
            for w in weights
        ]
    )
    return backbone


def compile_task(task, optimizer: keras.optimizers.Optimizer | None = None, loss="auto"):
    """Compile `task` with KerasHub's loss and metric and a comparable optimizer.

    `CausalLM.compile`'s defaults are `Adam(2e-5)`,
    `SparseCategoricalCrossentropy(from_logits=True)` and
    `weighted_metrics=[SparseCategoricalAccuracy()]`; too small a rate to see a tiny
    model move, so the optimizer here defaults to `Adam(1e-3)`. Loss and metric stay
    `"auto"`; the sampler is greedy so `generate` is deterministic.

    Args:
        task: a `CausalLM`.
        optimizer: a fresh optimizer; `None` for `keras.optimizers.Adam(1e-3)`.
        loss: KerasHub's `"auto"`, or a loss (e.g. a per-token mean:
            `reduction="mean_with_sample_weight"`).

    Returns:
        `task`, compiled.
    """
    task.compile(
        optimizer=keras.optimizers.Adam(1e-3) if optimizer is None else optimizer,
        loss=loss,
        sampler="greedy",
    )
    return task


def make_task(
    seed: int = 0,
    *,
    optimizer: keras.optimizers.Optimizer | None = None,
    sequence_length: int = SEQUENCE_LENGTH,
    loss="auto",
):
    """A tiny `GPT2CausalLM` with its preprocessor; same seed, same weights.

    Args:
        seed: seeds the initial weights (`make_backbone`).
        optimizer: a fresh optimizer; `None` for `Adam(1e-3)` (see `compile_task`).
        sequence_length: of the preprocessor and the position embedding.
        loss: as in `compile_task`.

    Returns:
        The compiled task. `task.fit(texts, batch_size=4, shuffle=False)` trains on raw
        strings; `task.generate("the", max_length=8)` decodes greedily.
    """
    import keras_hub

    preprocessor = make_preprocessor(sequence_length)
    backbone = make_backbone(
        preprocessor.tokenizer.vocabulary_size(), seed=seed, sequence_length=sequence_length
    )
    task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
    return compile_task(task, optimizer, loss)


def copy_task(task, optimizer: keras.optimizers.Optimizer | None = None, loss="auto"):
    """A fresh `GPT2CausalLM` with `task`'s weights and preprocessor, compiled anew.

    Args:
        task: the task to copy (its optimizer state is not copied).
        optimizer: as in `compile_task`.
        loss: as in `compile_task`.

    Returns:
        The copy; training it leaves `task` unchanged.
    """
    backbone = type(task.backbone).from_config(task.backbone.get_config())
    copy = type(task)(backbone=backbone, preprocessor=task.preprocessor)
    copy.set_weights(task.get_weights())
    return compile_task(copy, optimizer, loss)


def token_counts(task, texts: Sequence[str]) -> np.ndarray:
    """Unmasked target tokens of each text: its `sample_weight` summed.

    The compiled loss of a batch of `b` texts is (sum of its masked token losses) /
    (b * sequence_length); the exact large-batch weight of a micro-batch is therefore
    its number of samples times `sequence_length`, not the sum of these counts.

    Args:
        task: a `CausalLM` with a preprocessor.
        texts: strings.

    Returns:
        An int array of shape `(len(texts),)`.
    """
    _, _, sample_weight = task.preprocessor(list(texts))
    return np.asarray(keras.ops.convert_to_numpy(sample_weight)).sum(axis=1).astype(int)


def reference_fit_on_windows(
    task,
    texts: Sequence[str],
    window_sizes: Sequence[int],
    epochs: int = 1,
    *,
    optimizer: keras.optimizers.Optimizer | None = None,
    loss="auto",
):
    """The large-batch reference: a copy of `task` fits each window as one batch.

    Windows are consecutive slices of `texts` of the given sizes (a window is the
    concatenation of its micro-batches). They go to one `copy.fit` call as a
    `tf.data.Dataset` with one batch per window, so KerasHub's own pipeline runs as in
    training (`PipelineModel.fit` maps the preprocessor over each batch) and its
    `tf.data` map is traced once, not once per window as one `fit(window,
    batch_size=len(window))` per window would (about 4 s each on a CPU); the updates
    are the same.

    Args:
        task: the task at its initial weights (left unchanged).
        texts: the strings of one epoch, in order.
        window_sizes: samples per window; they must add up to `len(texts)`.
        epochs: passes over the windows.
        optimizer: a fresh optimizer for the copy; `None` for `Adam(1e-3)`.
        loss: the copy's loss, as in `compile_task`.

    Returns:
        The trained copy; `copy.optimizer.iterations` counts its windows.

    Raises:
        ValueError: a window size below 1, or sizes that do not add up to the texts.
    """
    import tensorflow as tf

    texts = list(texts)
    sizes = [int(size) for size in window_sizes]
    if not sizes or min(sizes) < 1 or sum(sizes) != len(texts):
        raise ValueError(
            "`window_sizes` must be integers >= 1 adding up to "
            f"len(texts)={len(texts)}. Received: window_sizes={list(window_sizes)}"
        )
    starts = np.cumsum([0, *sizes])
    windows = [
        tf.data.Dataset.from_tensor_slices(texts[start:stop]).batch(stop - start)
        for start, stop in zip(starts[:-1], starts[1:])
    ]
    dataset = windows[0]
    for window in windows[1:]:
        dataset = dataset.concatenate(window)
    copy = copy_task(task, optimizer, loss)
    copy.fit(dataset, epochs=epochs, shuffle=False, verbose=0)
    return copy
