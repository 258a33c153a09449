"""--ray and --replicas as flags, the address a public app may join, and a device field's placement (no cluster
needed: engine/fleet/config.py and engine/config/placement.py import no ray)."""

from __future__ import annotations

import sys

import pytest

from engine.config.placement import ANYWHERE, Placement, split_device
from engine.errors import InvalidRequest
from engine.fleet.config import LOCAL, private_address, resolve_address


@pytest.mark.parametrize(("text", "device", "placement"), [
    ("cpu", "cpu", ANYWHERE),
    ("cuda:H100", "cuda", Placement(chip="H100")),
    ("cpu:node:host-b", "cpu", Placement(node="host-b")),
    ("node:host-b", "auto", Placement(node="host-b")),
    ("tpu:TPU-V6E", "tpu", Placement(chip="TPU-V6E")),
])
def test_a_device_field_names_a_chip_or_a_node(text, device, placement):
    assert split_device(text) == (device, placement)


@pytest.mark.parametrize("text", ["cpu:node:", "cuda:H 100", "cuda:a/b", "cuda:x:y", "cpu:" + "n" * 120])
def test_a_bad_placement_says_what_to_write(text):
    with pytest.raises(InvalidRequest, match="node:NAME|names no node"):
        split_device(text)


def test_a_placement_without_a_cluster_is_refused_naming_the_flag(cache_dir, tiny_models):
    from helpers import engine_manager

    with engine_manager(cache_dir) as manager, pytest.raises(InvalidRequest, match="--ray"):
        manager.gate.make_key("tiny-shapes", "cpu:node:host-a", "fp32")


def test_auto_is_rays_address_or_a_local_cluster():
    assert resolve_address("auto", None) == LOCAL
    assert resolve_address("auto", "10.0.0.5:6379") == "10.0.0.5:6379"
    assert resolve_address("192.168.1.2:6379", "10.0.0.5:6379") == "192.168.1.2:6379"


@pytest.mark.parametrize(("address", "private"), [
    (LOCAL, True), ("127.0.0.1:6379", True), ("10.1.2.3:6379", True), ("ray://192.168.0.9:10001", True),
    ("localhost:6379", True), ("[::1]:6379", True), ("34.120.1.1:6379", False), ("ray.example.com:6379", False),
])
def test_which_addresses_are_private(address, private):
    assert private_address(address) is private


def _hosting(argv, monkeypatch):
    import app
    from engine.serving.flags import hosting_config, resolve_hosting

    monkeypatch.setattr(sys, "argv", ["app.py"])
    args = app.build_parser().parse_args(argv)
    return hosting_config(args, resolve_hosting(args), "tiny-shapes")


def test_public_with_ray_refuses_a_public_address_unless_told(monkeypatch):
    with pytest.raises(SystemExit, match="--ray-any-address"):
        _hosting(["--public", "--ray", "34.120.1.1:6379"], monkeypatch)
    hosting = _hosting(["--public", "--ray", "34.120.1.1:6379", "--ray-any-address"], monkeypatch)
    assert hosting.fleet.address == "34.120.1.1:6379"
    assert _hosting(["--public", "--ray", "10.0.0.5:6379", "--replicas", "3"], monkeypatch).fleet.replicas == 3
    assert _hosting([], monkeypatch).fleet is None


def test_replicas_need_ray_and_a_bound(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="--replicas needs --ray"):
        _hosting(["--replicas", "2"], monkeypatch)
    with pytest.raises(SystemExit):
        _hosting(["--ray", "--replicas", "99"], monkeypatch)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # no cluster file either (the fleet tests' session cluster writes one into this process's RAY_TMPDIR)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert _hosting(["--ray"], monkeypatch).fleet.address == LOCAL
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert _hosting(["--ray"], monkeypatch).fleet.address == "10.0.0.5:6379"


@pytest.mark.parametrize(("device", "options"), [
    ("cpu", {"num_cpus": 1}),
    ("cuda", {"num_cpus": 0, "num_gpus": 1}),
    ("neuron", {"num_cpus": 0, "resources": {"neuron_cores": 1}}),
    ("tpu", {"num_cpus": 0, "resources": {"TPU": 1}}),
    ("mps", {"num_cpus": 0, "resources": {"showcase-mps": 1}}),
])
def test_each_device_asks_ray_for_one_unit_of_its_resource(device, options):
    from engine import devices

    assert devices.get_device(device).ray_actor_resources() == options


# -- issue 50, item 5: the address a public app joins is resolved before the check -------------------------------
PUBLIC = "8.8.8.8:6379"


def test_a_public_app_checks_the_address_ray_would_read_from_the_environment_or_its_cluster_file(
        monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(PUBLIC + "\n")
    with pytest.raises(SystemExit, match=f"--ray {PUBLIC}: a public app joins only"):
        _hosting(["--public", "--ray"], monkeypatch)  # auto: the cluster file names it
    monkeypatch.setenv("RAY_ADDRESS", PUBLIC)
    with pytest.raises(SystemExit, match=f"--ray {PUBLIC}"):
        _hosting(["--public", "--ray", "auto"], monkeypatch)
    # local starts a cluster of this machine, whatever the environment and the cluster file name
    assert _hosting(["--public", "--ray", "local"], monkeypatch).fleet.address == LOCAL
    assert resolve_address("auto", None, "10.0.0.7:6379") == "10.0.0.7:6379"


def test_ray_local_starts_its_own_cluster_and_says_the_environments_address_is_ignored(monkeypatch, caplog):
    """ray.init(address=None) reads RAY_ADDRESS and Ray's cluster file; "local" reads neither (ray.init mocked:
    nothing starts, nothing is reached)."""
    import logging

    pytest.importorskip("ray")
    from engine.fleet import cluster
    from engine.fleet.config import FleetConfig

    calls = []
    monkeypatch.setenv("RAY_ADDRESS", PUBLIC)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cluster.ray, "put", lambda value: None)
    monkeypatch.setattr(cluster, "nodes", lambda: ["this machine"])
    with caplog.at_level(logging.INFO, logger="engine.fleet.cluster"):
        cluster.join(FleetConfig(address=LOCAL))
    (kwargs,) = calls
    assert kwargs["address"] == "local" and kwargs["include_dashboard"] is False
    assert kwargs["_temp_dir"] == "/tmp/ray"  # no cache folder named: Ray's own
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"RAY_ADDRESS ({PUBLIC}) is ignored" in line for line in lines), lines
    assert lines[-1] == "joined the Ray cluster at local: 1 node(s)"


def test_a_local_clusters_sessions_and_logs_go_under_the_cache_folder_when_its_path_allows(monkeypatch, tmp_path):
    from engine.fleet.config import RAY_DEFAULT_TEMP_DIR, RAY_TEMP_DIR_CHARS, FleetConfig

    short = "/srv/cache/ray"
    assert FleetConfig(temp_dir=short).local_temp_dir() == short
    assert FleetConfig(temp_dir="/" + "c" * RAY_TEMP_DIR_CHARS + "/ray").local_temp_dir() == RAY_DEFAULT_TEMP_DIR
    assert FleetConfig().local_temp_dir() == RAY_DEFAULT_TEMP_DIR
    hosting = _hosting(["--ray", "local", "--cache-dir", str(tmp_path)], monkeypatch)
    assert hosting.fleet.temp_dir == str(tmp_path / "ray")
