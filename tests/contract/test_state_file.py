"""The weights and the window state saved as one consistent pair (issue 43, items 1
and 2), on every backend (this module runs in the TensorFlow and in the JAX
process): a state that belongs to other weights, another model or another window
rule, or a damaged state file, is a clear error that names the file and changes
nothing; `BackupAndRestore(double_checkpoint=True)` falling back to its backup
gets the window saved with the backup weights. The kill test
(tests/test_kill_during_save.py) kills real processes inside saves."""

from __future__ import annotations

import os
import re
import shutil

import keras
import numpy as np
import pytest
from largebatch import SCE, assert_optimizer_close, assert_weights_close, data, mlp

import gradaccum
from gradaccum import saving, state_file
from gradaccum.attach import accumulation_of


def _trainer(steps=4, seed=0, **options):
    model = gradaccum.accumulate(mlp(seed), steps=steps, **options)
    model.compile(keras.optimizers.Adam(0.05), SCE, steps_per_execution=1)
    return model


def _ready(model):
    model.build((None, 6))
    model.optimizer.build(model.trainable_variables)
    return model


def _weights(model):
    return [w.copy() for w in model.get_weights()]


def _saved_mid_window(tmp_path, name="mid", count=24, **options):
    """A model trained on `count` samples in micro-batches of 4 with carry (windows
    of 4 left open), saved; returns (path, model)."""
    x, y = data(40)
    model = _trainer(partial="carry", **options)
    model.fit(x[:count], y[:count], batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / f"{name}.weights.h5")
    model.save_weights(path)
    return path, model


def test_a_save_leaves_the_weights_and_one_state_file_and_nothing_else(tmp_path):
    path, model = _saved_mid_window(tmp_path)
    model.save_weights(path)
    assert sorted(os.listdir(tmp_path)) == ["mid.weights.h5", "mid.weights.h5.gradaccum.npz"]
    # The weights file is Keras's: a plain model loads it.
    plain = mlp(3)
    plain.load_weights(path)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_state_saved_with_other_weights_is_an_error_that_changes_nothing(tmp_path):
    path, _ = _saved_mid_window(tmp_path, "a", count=24)
    other, _ = _saved_mid_window(tmp_path, "b", count=12)
    shutil.copy(other, path)  # b's weights beside a's state
    model = _ready(_trainer(seed=5))
    before = _weights(model)
    message = (f"The accumulation state file {path}{saving.SIDECAR} was not saved with "
               f"the weights in {path} (a weights file copied, restored or saved "
               "without the state file beside it?)")
    with pytest.raises(ValueError, match=re.escape(message)):
        model.load_weights(path)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Deleting the state file (the way out the error gives) loads the weights with
    # an empty window.
    os.remove(path + saving.SIDECAR)
    model.load_weights(path)
    assert gradaccum.attach.accumulation_of(model).open_micro_batches() == 0


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_state_file_is_an_error_naming_it(tmp_path, damage):
    path, _ = _saved_mid_window(tmp_path)
    sidecar = path + saving.SIDECAR
    if damage == "truncated":
        with open(sidecar, "r+b") as f:
            f.truncate(os.path.getsize(sidecar) // 2)
    elif damage == "garbage":
        with open(sidecar, "wb") as f:
            f.write(b"not a state file" * 10)
    else:
        open(sidecar, "wb").close()
    model = _ready(_trainer(seed=5))
    with pytest.raises(ValueError, match=re.escape(
            f"The accumulation state file {sidecar} cannot be read (")) as caught:
        model.load_weights(path)
    assert "truncated or damaged" in str(caught.value)
    assert "delete it to load the weights with an empty window" in str(caught.value)


def test_a_state_for_another_window_rule_or_model_is_an_error(tmp_path):
    path, _ = _saved_mid_window(tmp_path)
    with pytest.raises(ValueError, match=re.escape(
            "was saved for another window rule (steps=4; this model's: steps=8)")):
        _ready(_trainer(steps=8)).load_weights(path)
    with pytest.raises(ValueError, match=re.escape(
            "was saved for another window rule (weighting='exact'; this model's: "
            "weighting='uniform')")):
        _ready(_trainer(weighting="uniform")).load_weights(path)
    wider = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    gradaccum.accumulate(wider, steps=4, partial="carry")
    wider.compile(keras.optimizers.Adam(0.05), SCE)
    before = _weights(_ready(wider))
    with pytest.raises(ValueError, match=re.escape(
            "was saved for another model (trainable variables of shapes (6, 8), (8,), "
            "(8, 3), (3,); this model's: (6, 16), (16,), (16, 3), (3,))")):
        wider.load_weights(path)
    for a, b in zip(before, wider.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_state_file_of_another_format_is_an_error(tmp_path):
    path, _ = _saved_mid_window(tmp_path)
    with np.load(path + saving.SIDECAR) as store:
        values = {k: store[k] for k in store.files if not k.startswith("gradaccum@")}
    np.savez(path + saving.SIDECAR, **values)  # as gradaccum wrote it before (format 1)
    with pytest.raises(ValueError, match=re.escape(
            "has gradaccum's first format, saved apart from its weights; this "
            f"gradaccum reads {state_file.READS_TEXT}")):
        _ready(_trainer()).load_weights(path)


def test_killed_between_the_two_renames_the_previous_pair_loads(tmp_path, monkeypatch):
    # The state file is renamed first (holding the new state and the previous
    # one), then the weights: killed between the two, the disk holds the previous
    # weights, and loading them gets the previous window.
    x, y = data(40)
    path, model = _saved_mid_window(tmp_path, count=24)
    first = _weights(model)
    model.fit(x[24:32], y[24:32], batch_size=4, epochs=1, shuffle=False, verbose=0)
    real_replace = os.replace

    def replace(source, target):
        if os.fspath(target) == path:
            raise KeyboardInterrupt("killed")
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        model.save_weights(path)
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(os.listdir(tmp_path)) == ["mid.weights.h5", "mid.weights.h5.gradaccum.npz"]
    resumed = _ready(_trainer(seed=5))
    resumed.load_weights(path)
    for a, b in zip(first, resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    # The previous window: 24 samples = one update and 2 micro-batches open.
    assert gradaccum.attach.accumulation_of(resumed).open_micro_batches() == 2
    resumed.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    full = _trainer()
    full.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(resumed, full)
    assert_optimizer_close(resumed.optimizer, full.optimizer)


def test_backup_and_restore_falls_back_with_the_backups_window(tmp_path):
    # 10 micro-batches of 4 per epoch, windows of 3 carried across epochs, a save
    # after every micro-batch with a backup of the one before. Interrupted inside a
    # window, the main weights file then damaged: BackupAndRestore falls back to
    # its backup, and the window saved with it goes on; the run ends as the
    # uninterrupted one.
    x, y = data(40)

    def make(seed=0):
        return _trainer(steps=3, seed=seed, partial="carry")

    full = make()
    full.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (1, 4):
                raise RuntimeError("interrupted")

    backup = str(tmp_path / "backup")

    def backup_and_restore():
        return keras.callbacks.BackupAndRestore(backup, save_freq=1, double_checkpoint=True)

    model = make()
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                  callbacks=[backup_and_restore(), Interrupt()])
    main = os.path.join(backup, "latest.weights.h5")
    assert os.path.exists(main + ".bkp")
    with open(main, "wb") as f:
        f.write(b"damaged")
    resumed = make(seed=9)
    history = resumed.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                          callbacks=[backup_and_restore()])
    assert_weights_close(resumed, full)
    assert_optimizer_close(resumed.optimizer, full.optimizer)
    assert history.history["updates"][-1] == float(int(full.optimizer.iterations))


def test_with_no_open_window_another_rule_or_frozen_layers_load(tmp_path):
    # A window that closed with the data (partial="flush") leaves nothing open:
    # a model with another rule, or with a layer frozen, loads the weights.
    x, y = data(40)
    model = _trainer()
    model.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "closed.weights.h5")
    model.save_weights(path)
    updates = accumulation_of(model).window_values("updates")
    assert updates == [2]  # one window of 4, the 2 left flushed
    for loader in (_trainer(steps=8), _trainer(weighting="uniform")):
        _ready(loader).load_weights(path)
        for a, b in zip(loader.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
        # The counters go on (a schedule's position among them).
        assert accumulation_of(loader).window_values("updates") == updates
    frozen = mlp(4)
    frozen.layers[0].trainable = False
    gradaccum.accumulate(frozen, steps=4)
    frozen.compile(keras.optimizers.Adam(0.05), SCE)
    _ready(frozen).load_weights(path)
    np.testing.assert_array_equal(frozen.get_weights()[0], model.get_weights()[0])


def test_skip_mismatch_drops_an_open_window_of_another_rule_with_a_warning(tmp_path):
    path, model = _saved_mid_window(tmp_path)
    loader = _ready(_trainer(steps=8))
    with pytest.warns(UserWarning, match="gradaccum drops the open window saved in"):
        loader.load_weights(path, skip_mismatch=True)
    assert gradaccum.attach.accumulation_of(loader).open_micro_batches() == 0
    for a, b in zip(loader.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_saves_keep_file_modes_write_through_links_and_take_keras_arguments(tmp_path):
    path, model = _saved_mid_window(tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    for name in ("mid.weights.h5", "mid.weights.h5.gradaccum.npz"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~umask, name
    os.chmod(path, 0o640)
    model.save_weights(path, True)  # Keras's positional `overwrite`
    assert os.stat(path).st_mode & 0o777 == 0o640
    # A link to the weights is written through, as Keras writes.
    target = tmp_path / "runs"
    target.mkdir()
    link = tmp_path / "latest.weights.h5"
    os.symlink(target / "ckpt.weights.h5", link)
    model.save_weights(link)
    assert os.path.islink(link) and (target / "ckpt.weights.h5").exists()
    for name in (link, target / "ckpt.weights.h5"):  # the pair is the file's
        resumed = _ready(_trainer(seed=5))
        resumed.load_weights(name)
        assert gradaccum.attach.accumulation_of(resumed).open_micro_batches() == 2
    # Keras shards a `max_shard_size` save whatever its name: the file there
    # stays as it was, and the shards load with their window.
    before = open(path, "rb").read()
    model.save_weights(path, True, 0.0001)
    assert open(path, "rb").read() == before
    resumed = _ready(_trainer(seed=5))
    resumed.load_weights(str(tmp_path / "mid.weights.json"))
    assert gradaccum.attach.accumulation_of(resumed).open_micro_batches() == 2


def test_a_sharded_save_is_tied_to_its_shards(tmp_path):
    # Keras lists the shards in its .weights.json; the digest covers them, so
    # shards of an older save beside a newer state are refused, not loaded with
    # the wrong window.
    x, y = data(40)
    path, model = _saved_mid_window(tmp_path)
    sharded = str(tmp_path / "sharded.weights.json")
    model.save_weights(sharded, max_shard_size=0.0001)
    shards = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sharded_"))
    assert shards
    saved = {name: (tmp_path / name).read_bytes() for name in shards}
    # Two saves later, after an update each (a pair is tied by its weights' bytes:
    # saves with no update between them hold the same weights, and any of their
    # windows goes with them), the first save's shards are neither entry's.
    for start in (24, 32):
        model.fit(x[start:start + 8], y[start:start + 8], batch_size=4, epochs=1,
                  shuffle=False, verbose=0)
        model.save_weights(sharded, max_shard_size=0.0001)
    for name, content in saved.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match="was not saved with the weights in"):
        _ready(_trainer(seed=5)).load_weights(sharded)


def test_bfloat16_sums_save_and_resume_exactly(tmp_path):
    """bfloat16 accumulators go into the state file as float32 (NumPy has no
    bfloat16 of its own, and `np.savez` would write raw bytes no load reads back),
    and come back as they were, on every backend."""
    path, model = _saved_mid_window(tmp_path, count=24, accumulator_dtype="bfloat16")
    saved = accumulation_of(model).saved_variables()
    sums = [keras.ops.convert_to_numpy(keras.ops.cast(saved[f"accumulator_{i}"], "float32"))
            for i in range(4)]
    assert accumulation_of(model).open_micro_batches() == 2 and np.any(sums[0])
    resumed = _trainer(partial="carry", seed=5, accumulator_dtype="bfloat16")
    _ready(resumed)
    resumed.load_weights(path)
    restored = accumulation_of(resumed).saved_variables()
    assert accumulation_of(resumed).open_micro_batches() == 2
    for i, expected in enumerate(sums):
        value = restored[f"accumulator_{i}"]
        assert keras.backend.standardize_dtype(value.dtype) == "bfloat16"
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(keras.ops.cast(value, "float32")), expected)
    x, y = data(40)
    for trained in (model, resumed):
        trained.fit(x[24:], y[24:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(resumed, model)
