"""Test session set-up shared by tests/ and the doctests under src/."""

import functools
import gc
import importlib.util
import os
import pathlib

import pytest
from hypothesis import settings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each pytest-xdist worker runs its ops on its share of the cores (one thread on
    # this project's 2-core machines, where scripts/test.sh runs two workers), set
    # before its backend starts. With TensorFlow's and PyTorch's default, a thread per
    # core in every worker, the workers' threads outnumber the cores: the fast tier
    # took 285 s of CPU time on TensorFlow against 239 s, and 95 s on PyTorch against
    # 47 s (52 s of wall time against 29 s). JAX's tests ran as fast either way.
    _share = str(max(1, len(os.sched_getaffinity(0))
                     // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ.setdefault("OMP_NUM_THREADS", _share)
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", _share)

# `bash scripts/test.sh --fast` loads this profile (`--hypothesis-profile=fast`); the
# full suite runs the examples each test asks for.
settings.register_profile("fast", max_examples=3)

TESTS = pathlib.Path(__file__).resolve().parent / "tests"


def _tiers():
    spec = importlib.util.spec_from_file_location("tiers", TESTS / "tiers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TIERS = _tiers()
ROOT = pathlib.Path(__file__).resolve().parent


@functools.cache
def _shares_fixtures(module: str) -> bool:
    """Whether the test module `module` (a path from the root) defines a fixture that
    its tests share (module- or class-scoped: a built site, a trained task)."""
    path = ROOT / module
    if path.suffix != ".py" or not path.is_file():
        return False
    source = path.read_text()
    return 'scope="module"' in source or 'scope="class"' in source


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        """xdist's `load` distribution, except that the tests of a module with a
        shared fixture go to one worker, which makes the fixture once (not once per
        worker that runs one of them). xdist's own `loadgroup` cannot do it under
        pytest 9, whose node ids it can no longer rename."""
        if config.getvalue("dist") != "load":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class SharedFixtureScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                module = nodeid.split("::")[0]
                return module if _shares_fixtures(module) else nodeid

        return SharedFixtureScheduling(config, log)


def pytest_ignore_collect(collection_path, config):
    """The JAX and PyTorch adapters' examples set their backend: their doctests run in
    that backend's process (tests/jax_backend/test_jax_docs.py,
    tests/torch_backend/test_torch_docs.py)."""
    parts = pathlib.Path(str(collection_path)).parts
    if "backends" in parts and "gradaccum" in parts:
        backend = os.environ.get("KERAS_BACKEND", "tensorflow")
        if any(name in parts and name != backend for name in ("jax", "torch")):
            return True
    return None


def _xdist_controller(config) -> bool:
    """Whether this process is pytest-xdist's controller (`-n 2`): it starts the
    workers and gathers their reports, and imports neither Keras nor TensorFlow (3 to 6
    s of every run's start on this project's machines)."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(
        config, "workerinput")


def pytest_configure(config):
    """Two logical CPU devices for the tf.distribute tests, before TensorFlow starts
    (not in the JAX and PyTorch processes: tests/jax_backend, tests/torch_backend)."""
    if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
        return
    if _xdist_controller(config):  # it runs no test: its workers set up their own
        return
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
    except RuntimeError:  # TensorFlow has started already
        pass


@pytest.fixture(autouse=True)
def _own_collective_keys():
    """Each test's tf.distribute strategies take collective keys no other test's take.

    A MirroredStrategy numbers its collectives from `_collective_key_base`; two made
    in one process from the same base (a documented block's `MirroredStrategy()`, the
    suite's shared two-replica strategy) hand out the same keys, and TensorFlow aborts
    the second's reductions with a shape mismatch. TensorFlow's own tests move the base
    by 100000 before each strategy (tensorflow/python/distribute/strategy_combinations.py).
    """
    if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        from tensorflow.python.distribute import mirrored_strategy

        mirrored_strategy.MirroredStrategy._collective_key_base += 100000
    yield


def _node(item) -> str | None:
    """The item's node id relative to tests/, or None outside tests/."""
    path = pathlib.Path(str(item.path)).resolve()
    if TESTS not in path.parents:
        return None
    return path.relative_to(TESTS).as_posix() + item.nodeid[len(item.nodeid.split("::")[0]):]


def _by_module(keys) -> dict[str, list[str]]:
    """A table's keys grouped by the test module they name (matching a node against
    only its module's keys: a second of every worker's start instead of two)."""
    grouped: dict[str, list[str]] = {}
    for key in keys:
        grouped.setdefault(key.split("::")[0].split("[")[0], []).append(key)
    return grouped


def _named(node: str, grouped: dict[str, list[str]]) -> bool:
    return any(TIERS.matches(node, key) for key in grouped.get(node.split("::")[0], ()))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Applies tests/tiers.py: markers by table, FEATURES never slow, and a check that
    every key of its tables still names a collected test (a renamed test fails the
    collection instead of silently changing tier)."""
    nodes = {item: _node(item) for item in items}
    features = _by_module(TIERS.FEATURES.values())
    markers = {marker: _by_module(keys) for marker, keys in TIERS.MARKERS.items()}
    for item, node in nodes.items():
        if node is None:
            continue
        for marker, keys in markers.items():
            if marker == "slow" and _named(node, features):
                continue
            if _named(node, keys):
                item.add_marker(marker)
        if _named(node, features) and item.get_closest_marker("slow"):
            raise pytest.UsageError(
                f"tests/tiers.py: {node} stands for a feature in the fast tier (FEATURES) "
                "but is marked slow."
            )
    # The check needs whole modules: not with tests asked for by id, nor with the
    # cache's --lf / --sw, which leave out part of a module while collecting it.
    if any("::" in arg for arg in config.args) or any(
        getattr(config.option, name, False) for name in ("lf", "stepwise")
    ):
        return
    modules = {node.split("::")[0] for node in nodes.values() if node}
    tables = {f"FEATURES[{feature!r}]": [key] for feature, key in TIERS.FEATURES.items()}
    tables.update({name: getattr(TIERS, name) for name in
                   ("SLOW", "HUB", "MULTI_DEVICE", "SUBPROCESS", "BOTH_DOORS")})
    in_module: dict[str, list[str]] = {}
    for node in nodes.values():
        if node:
            in_module.setdefault(node.split("::")[0], []).append(node)
    for table, keys in tables.items():
        for key in keys:
            if "*" in key and not (key.endswith("*") and "[" in key):
                raise pytest.UsageError(
                    f"tests/tiers.py: {table} names {key!r}: a `*` may only end a "
                    "test's case (`test_x.py::test_y[prefix*`)."
                )
            if key.split("::")[0] not in modules:
                continue
            named = [node for node in in_module.get(key.split("::")[0].split("[")[0], ())
                     if TIERS.matches(node, key)]
            if table == "BOTH_DOORS":  # the wrap case is what the row is for
                named = [node for node in named if "wrap" in node.partition("[")[2]]
            if not named:
                raise pytest.UsageError(
                    f"tests/tiers.py: {table} names {key!r}, which is not a collected test"
                    + (" through `wrap`." if table == "BOTH_DOORS" else ".")
                )


def pytest_runtest_logfinish(nodeid, location):
    """After each test: collect its garbage, then freeze what is left (`gc.freeze`),
    so that Python's collector no longer walks it. A worker of this suite holds
    millions of objects (Keras models, traced functions, compiled steps); walked at
    every collection, they made an eager test 5 to 20 times slower late in a run than
    alone (tests/test_properties.py: 3.4 s alone, 72 s late in a run). What a test
    creates is still collected: frozen are only the objects alive when it ended."""
    gc.collect()
    gc.freeze()
