"""Shared fixtures: one persistent cache folder, tiny models built once, one engine manager per session.

The cache folder (<repo>/.cache/test) persists between runs on the same machine, like a real
deployment's --cache-dir: tiny models are built once and inductor's cache is reused.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEST_CACHE = Path(os.environ.get("SHOWCASE_TEST_CACHE", REPO / ".cache" / "test"))

# Before anything imports torch or huggingface_hub: offline, quiet, caches in the test folder.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ["SHOWCASE_CACHE_DIR"] = str(TEST_CACHE)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(TEST_CACHE / "inductor"))
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# One compute thread per process: two test workers already fill two cores, and inductor writes the thread
# count into its CPU kernels, so engines a manager starts (one thread each when it allows several engines)
# and those a test starts on its own would otherwise compile the same graph twice under two keys.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Compiles in the compiling process, without inductor's pool of compile workers (each a fresh Python importing
# torch): on two busy cores the pool only adds start-up. The soak (tests/test_hosting.py) keeps the pool, so a
# SIGTERM in the middle of a compile still meets its workers.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    return TEST_CACHE


# Under `pytest -n 2` (pytest-xdist) each module runs whole on one worker, so a module's fixtures are built once.
# These modules start torchrun ranks or a Ray cluster: they share one group, so they never run beside each other.
HOST_WIDE_PROCESSES = {"test_tp.py", "test_tp_multinode.py", "test_cp.py", "test_fleet.py"}


def test_group(nodeid: str) -> str:
    """The unit of work a test is handed out in: its module, or the host-wide group."""
    module = nodeid.split("::", 1)[0].split("@", 1)[0]
    return "host-wide-processes" if Path(module).name in HOST_WIDE_PROCESSES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Hand out whole modules (and the host-wide group). xdist's own `--dist loadgroup` marks do not group
    under pytest 9.2 (it renames `item._nodeid`, which pytest no longer reads), so the grouping is ours."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(nodeid)

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Longest first (make test passes --no-loadscope-reorder, so this is the order the groups are handed
        # out): a group's slow and browser tests stand for its time, the quick modules fill in at the end.
        weight = {}
        for item in items:
            heavy = item.get_closest_marker("slow") or item.get_closest_marker("browser")
            group = test_group(item.nodeid)
            weight[group] = weight.get(group, 0) + (1 if heavy else 0)
        items.sort(key=lambda item: -weight[test_group(item.nodeid)])  # stable: a module keeps its own order


@pytest.fixture(scope="session")
def tiny_models(cache_dir) -> dict[str, Path]:
    """Every random-weight tiny pipeline, built once (rebuilt only if the cache is wiped)."""
    from engine.models.tiny import TINY_PRESETS, ensure_tiny_pipeline
    from engine.settings import models_dir

    return {name: ensure_tiny_pipeline(name, models_dir(cache_dir)) for name in TINY_PRESETS}


@pytest.fixture(scope="session")
def manager(cache_dir, tiny_models):
    """A session-wide engine manager with no start-up warm-up (tests warm what they need)."""
    from helpers import engine_manager

    with engine_manager(cache_dir) as m:
        yield m


@pytest.fixture
def fresh_manager(cache_dir, tiny_models):
    """An engine manager of the test's own (no warm-up; engines start on first use): nothing earlier tests
    started or queued on the session's `manager` (a compile under way, a loaded engine) shows in it. Shut
    down, workers and all, when the test ends."""
    from helpers import engine_manager

    with engine_manager(cache_dir) as m:
        yield m


@pytest.fixture(scope="session")
def ray_cluster():
    """A Ray cluster of this machine for the fleet tests (engine/fleet/): a head with no CPUs (work goes to the
    nodes) and two nodes, `host-a` and `host-b` (2 CPUs and a custom resource of that name each, labelled with
    it), every one on loopback, no dashboard, small object stores. This process is its driver. Tests that
    remove a node add one of the same name back."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node on 127.0.0.1, not the host's interface
    # Ray puts its sockets under $TMPDIR/ray; a test folder there passes AF_UNIX's 107-byte path limit
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    import ray
    from helpers import fleet_node_args
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": 80 * 2**20})
    for name in ("host-a", "host-b"):
        cluster.add_node(**fleet_node_args(name))
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
