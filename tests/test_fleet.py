"""The fleet (engine/fleet/): engines as Ray actors on the nodes of a cluster, reached through the same
EngineClient as a worker process. Runs on `ray_cluster` (tests/conftest.py): two simulated nodes, host-a and
host-b, on loopback. Without --ray nothing imports ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import (
    engine_manager,
    fleet_actors_alive,
    fleet_node_args,
    free_port,
    make_request,
    own_processes,
    process_gone,
    wait_until,
)

pytestmark = pytest.mark.slow  # a Ray cluster, actors that import torch and load a pipeline

REPO = Path(__file__).resolve().parent.parent
PRESET = "tiny-shapes"
NO_RAY_AT_EXIT = """
import atexit, sys
atexit.register(lambda: print("RAY-MODULES", sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")),
                              file=sys.stderr, flush=True))
"""
APP_START = NO_RAY_AT_EXIT + """
import app
parser = app.build_parser()
args = parser.parse_args(["--device", "cpu", "--mode", "eager", "--warm", "none"])
engine = app.check_flags(parser, args)
hosting = app.resolve_hosting(args, engine.mode)
manager = app.build_manager(parser, args, engine, hosting)
app.join_fleet(None, manager)
manager.engine(manager.default_key).wait_ready(120)
manager.shutdown()
app.leave_fleet(manager.serving())
"""


def ray_modules(stderr: str) -> list[str]:
    (line,) = [x for x in stderr.splitlines() if x.startswith("RAY-MODULES")]
    return json.loads(line.removeprefix("RAY-MODULES ").replace("'", '"'))


def run_python(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def fleet_manager(cache_dir, tiny_models, ray_cluster):
    from engine.fleet.config import FleetConfig

    with engine_manager(cache_dir, fleet=FleetConfig(address=ray_cluster.address)) as manager:
        yield manager
    wait_until(lambda: not fleet_actors_alive(), 15, message="every engine actor gone after shutdown")


# -- without --ray -----------------------------------------------------------------------------------
def test_without_ray_the_app_and_the_cli_import_no_ray(cache_dir, tiny_models, tmp_path):
    app_help = run_python(NO_RAY_AT_EXIT + "import app\ntry:\n    app.main(['--help'])\nexcept SystemExit:\n    pass\n")
    assert app_help.returncode == 0 and "--ray" in app_help.stdout, app_help.stderr[-2000:]
    assert ray_modules(app_help.stderr) == []
    start = run_python(APP_START)  # the app's start-up phases, its default engine loaded and served
    assert start.returncode == 0, start.stderr[-3000:]
    assert ray_modules(start.stderr) == []
    cli = run_python(NO_RAY_AT_EXIT + "from engine.cli import main\nmain(sys.argv[1:])\n", "generate", "--preset",
                     PRESET, "--device", "cpu", "--mode", "eager", "--size", "64x64", "--steps", "1", "--out",
                     str(tmp_path / "x.png"), "--cache-dir", str(cache_dir))
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert ray_modules(cli.stderr) == []


# -- one engine on the fleet -------------------------------------------------------------------------
def test_a_ray_engine_serves_progress_timings_cancel_and_its_node(fleet_manager):
    from engine.config.request import ImageRequest
    from engine.errors import Cancelled

    steps = []
    result = fleet_manager.generate(ImageRequest(PRESET, prompt="a red circle", device="cpu", precision="fp32",
                                                 mode="eager", size="64x64", steps=3),
                                    on_progress=steps.append, timeout=300)
    assert result.image_png.startswith(b"\x89PNG") and result.timings.total_ms > 0
    assert [p.step for p in steps][-1] == 3
    (row,) = [r for r in fleet_manager.residency.status_rows() if r["state"] != "evicted"]
    assert row["kind"] == "ray" and row["node"] in ("host-a", "host-b") and row["state"] == "ready"
    # issue 51: the result (its line on the page, its timings' JSON) names the node that served it
    assert result.node == row["node"] and result.as_dict()["node"] == row["node"]
    assert len(fleet_actors_alive()) == 1
    # cancel reaches the actor through the same protocol
    engine = fleet_manager.residency.engines()[0]
    started = threading.Event()
    future = engine.submit(make_request(request_id="long-one", steps=200, prompt="a blue square"),
                           on_progress=lambda p: started.set())
    assert started.wait(120)
    engine.cancel("long-one")
    with pytest.raises(Cancelled):
        future.result(60)


def test_a_device_no_node_has_is_refused_naming_the_nodes(fleet_manager):
    from engine.errors import DeviceUnavailable

    with pytest.raises(DeviceUnavailable) as info:
        fleet_manager.gate.make_key(PRESET, "cuda", "fp32")
    assert "no node with cuda (GPU)" in str(info.value) and "host-a" in str(info.value)


# -- faults --------------------------------------------------------------------------------------------
def test_a_node_removed_mid_request_fails_that_request_naming_it_and_the_next_runs_elsewhere(fleet_manager,
                                                                                               ray_cluster):
    from engine.config.request import ImageRequest

    key = fleet_manager.gate.make_key(PRESET, "cpu", "fp32")
    engine = fleet_manager.engine(key)
    assert engine.wait_ready(300)
    name = engine.node_name
    node = next(n for n in ray_cluster.worker_nodes if n.node_id == engine.where["node_id"])
    started = threading.Event()
    future = engine.submit(make_request(request_id="doomed", steps=400, prompt="a green triangle"),
                           on_progress=lambda p: started.set())
    assert started.wait(120)
    ray_cluster.remove_node(node)
    try:
        with pytest.raises(Exception) as info:  # a TimeoutError after 10 s would not name the node
            future.result(10)
        assert f"Ray actor on node {name}" in str(info.value), info.value
        # the manager's restart asks Ray again: the other node takes it, and serves the next request
        result = fleet_manager.generate(ImageRequest(PRESET, prompt="a red circle", device="cpu", precision="fp32",
                                                     mode="eager", size="64x64", steps=2), timeout=300)
        assert result.image_png.startswith(b"\x89PNG")
        (row,) = [r for r in fleet_manager.residency.status_rows() if r["state"] != "evicted"]
        assert row["node"] != name and row["state"] == "ready"
    finally:
        ray_cluster.add_node(**fleet_node_args(name))
        ray_cluster.wait_for_nodes()


def test_sigterm_on_the_app_leaves_no_actor_and_no_engine_process(cache_dir, tiny_models, ray_cluster, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "SHOWCASE_CACHE_DIR": str(cache_dir)}
    log = tmp_path / "app.log"  # a file, not an unread pipe: a full pipe would block the app's logging
    with log.open("w") as out:
        app = subprocess.Popen([sys.executable, "app.py", "--ray", ray_cluster.address, "--device", "cpu", "--mode",
                                "eager", "--warm", "none", "--port", str(free_port()), "--no-mcp"], cwd=REPO,
                               env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        actors = wait_until(fleet_actors_alive, 180, interval=0.5,
                            message=lambda: f"the app's engine actor alive (app log: {log.read_text()[-3000:]})")
        pid = actors[0]["Pid"]
        app.send_signal(signal.SIGTERM)
        try:
            app.wait(30)
        except subprocess.TimeoutExpired:  # what the app was doing when it should have been gone
            raise AssertionError(f"the app still runs 30 s after SIGTERM; its log ends: {log.read_text()[-3000:]}") \
                from None
        wait_until(lambda: not fleet_actors_alive(), 10, interval=0.2, message="no engine actor left")
        if pid:
            wait_until(lambda: process_gone(pid), 10, message=f"the actor's process {pid} gone")
        assert own_processes("EngineActor") == []
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)


def test_the_fleet_bench_prints_both_paths_side_by_side(cache_dir, tiny_models, ray_cluster):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "bench", "fleet-bench", "--ray", ray_cluster.address, "--rounds", "3",
                          "--cache-dir", str(cache_dir), "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["node"] in ("host-a", "host-b") and result["target_ms"] == 15.0
    for path in ("local", "ray"):
        client = result[path]["client"]
        assert client["p10"] <= client["median"] <= client["p90"]
    assert result["overhead_ms"] == pytest.approx(result["ray"]["client"]["median"] - result["local"]["client"]["median"])
    assert not fleet_actors_alive()


# -- replicas ------------------------------------------------------------------------------------------
def served_by(replicas) -> dict[str, int]:
    """Requests each replica has served (its buckets' counts), by node."""
    return {r.node_name: sum(b.requests_served for b in r.buckets()) for r in replicas.replicas}


def test_replicas_split_requests_least_loaded_and_skip_a_stopped_one(cache_dir, tiny_models, ray_cluster):
    from engine.fleet.config import FleetConfig

    with engine_manager(cache_dir, {"max_batch": 1}, fleet=FleetConfig(address=ray_cluster.address, replicas=2)) as m:
        engine = m.engine(m.gate.make_key(PRESET, "cpu", "fp32"))
        assert engine.kind == "ray-replicas"
        wait_until(lambda: len(engine.serving_replicas()) == 2, 300, message="both replicas ready")
        assert {r.node_name for r in engine.replicas} == {"host-a", "host-b"}  # Ray spread them
        before = served_by(engine)
        futures = [engine.submit(make_request(request_id=f"split-{i}", steps=2, prompt="a red circle", seed=i))
                   for i in range(16)]
        assert all(f.result(300).image_png for f in futures)
        split = {node: count - before[node] for node, count in served_by(engine).items()}
        assert sum(split.values()) == 16 and all(5 <= n <= 11 for n in split.values()), split
        (row,) = [r for r in m.residency.status_rows() if r["state"] != "evicted"]
        assert row["kind"] == "ray-replicas" and {r["node"] for r in row["replicas"]} == {"host-a", "host-b"}

        stopped = engine.replicas[0]
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: stopped not in engine.serving_replicas(), 30, message="the stopped replica skipped")
            before = served_by(engine)
            futures = [engine.submit(make_request(request_id=f"stopped-{i}", steps=2, prompt="a blue square", seed=i))
                       for i in range(16)]
            assert all(f.result(300).image_png for f in futures)  # 0 failed
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        split = {node: count - before[node] for node, count in served_by(engine).items()}
        assert split[stopped.node_name] == 0 and sum(split.values()) == 16, split
        wait_until(lambda: stopped in engine.serving_replicas(), 30, message="the resumed replica back in rotation")


# -- placement and the device list ---------------------------------------------------------------------
def test_a_request_names_a_node_and_the_cluster_is_the_device_list(fleet_manager):
    from engine.config.request import ImageRequest
    from engine.errors import DeviceUnavailable

    on_b = fleet_manager.gate.make_key(PRESET, "cpu:node:host-b", "fp32")
    assert on_b.place == "node:host-b" and str(on_b) == f"{PRESET}@cpu:node:host-b/fp32"
    assert fleet_manager.gate.make_key(PRESET, "node:host-a", "fp32").device == "cpu"  # the best device host-a has
    for device in ("cpu:node:host-a", "cpu:node:host-b"):
        result = fleet_manager.generate(ImageRequest(PRESET, prompt="a red circle", device=device, precision="fp32",
                                                     mode="eager", size="64x64", steps=2), timeout=300)
        assert result.image_png.startswith(b"\x89PNG")
    nodes = {r["engine"]: r["node"] for r in fleet_manager.residency.status_rows()}
    assert nodes == {f"{PRESET}@cpu:node:host-a/fp32": "host-a", f"{PRESET}@cpu:node:host-b/fp32": "host-b"}
    with pytest.raises(DeviceUnavailable, match="no node 'nowhere'"):
        fleet_manager.gate.make_key(PRESET, "cpu:node:nowhere", "fp32")
    with pytest.raises(DeviceUnavailable, match="with chip H100"):
        fleet_manager.gate.make_key(PRESET, "cpu:H100", "fp32")

    report = {r["name"]: r for r in fleet_manager.serving().devices_report()}
    assert report["cpu"]["available"] and report["cpu"]["nodes"] == ["host-a", "host-b"] and report["cpu"]["auto"]
    assert report["cpu:node:host-a"]["nodes"] == ["host-a"]
    assert not report["cuda"]["available"] and "GPU" in report["cuda"]["reason"]
    cpu = fleet_manager.host_status()["devices"]["cpu"]  # budgets from what Ray reports: 2 nodes x 2 CPUs
    assert cpu["max_engines"] == 4 and "Ray cluster" in cpu["source"] and cpu["web_server_gib"] == 0
    cluster = fleet_manager.host_status()["cluster"]
    assert {"host-a", "host-b"} <= {n["name"] for n in cluster["nodes"]}
    scrape = fleet_manager.telemetry.scrape().decode()
    assert "showcase_cluster_nodes" in scrape and 'showcase_cluster_node_resource{chips="",node="host-a"' in scrape


def test_a_compare_across_two_nodes_prices_each_against_its_own_chip_and_the_reference_chip(fleet_manager):
    from gradio_client import Client
    from helpers import launch_demo

    from ui import UIDefaults, buckets_views

    demo, url = launch_demo(fleet_manager, UIDefaults(device="cpu", mode="eager"))
    try:
        client = Client(url, verbose=False)
        gallery, payload = client.predict(
            prompt="a red circle", preset=PRESET, size="64x64", steps=2, guidance=3.5, seed=7,
            devices=["cpu:node:host-a"], configurations="eager/fp32@cpu:node:host-a; eager/bf16@cpu:node:host-b",
            timing_s=3, api_name="/compare")
    finally:
        demo.close()
    results = {r["config"]: r for r in payload["results"]}
    reference, own, other = "cpu:node:host-a/fp32/eager", "cpu:node:host-b/fp32/eager", "cpu:node:host-b/bf16/eager"
    assert payload["reference"] == reference and list(results) == [reference, other, own]  # host-b's own, added
    # host-b's eager fp32 against the reference chip's image of the same prompt and seed: the cross-chip drift
    assert "drift_max_diff" in results[own] and "drift_max_diff" in results[other]
    for config in (own, other):
        assert results[config]["speedup_figure"]["images"] >= 1  # against the reference chip
    figure = results[other]["own_chip_figure"]  # and against eager fp32 on its own chip
    assert figure["images"] >= 1 and figure["iqr"][0] <= figure["speedup"] <= figure["iqr"][1]
    assert "vs eager fp32 on its chip" in gallery[1]["caption"] and "own_chip_figure" not in results[own]
    devices = {row[1] for row in buckets_views.board_rows(fleet_manager.residency.status_rows())}
    assert {"cpu on host-a", "cpu on host-b"} <= devices


def test_a_replica_on_a_lost_node_is_replaced_and_the_others_keep_serving(cache_dir, tiny_models, ray_cluster):
    from engine.fleet.config import FleetConfig

    with engine_manager(cache_dir, {"max_batch": 1}, fleet=FleetConfig(address=ray_cluster.address, replicas=2)) as m:
        engine = m.engine(m.gate.make_key(PRESET, "cpu", "fp32"))
        wait_until(lambda: len(engine.serving_replicas()) == 2, 300, message="both replicas ready")
        lost = engine.replicas[0]
        name = lost.node_name
        ray_cluster.remove_node(next(n for n in ray_cluster.worker_nodes if n.node_id == lost.where["node_id"]))
        try:
            wait_until(lambda: lost not in engine.replicas, 30, message="the lost replica replaced")
            futures = [engine.submit(make_request(request_id=f"after-{i}", steps=2, seed=i)) for i in range(4)]
            assert all(f.result(300).image_png for f in futures)  # served meanwhile, none failed
            wait_until(lambda: len(engine.serving_replicas()) == 2, 300, message="the replacement ready")
            assert {r.node_name for r in engine.replicas} == {"host-a", "host-b"} - {name}  # Ray put it there
        finally:
            ray_cluster.add_node(**fleet_node_args(name))
            ray_cluster.wait_for_nodes()


def test_a_node_that_joins_later_is_listed_and_used_by_its_chip(fleet_manager, ray_cluster):
    from engine.config.request import ImageRequest

    assert "cpu:T4" not in {r["name"] for r in fleet_manager.serving().devices_report()}
    # a node whose chip Ray would report as T4 (accelerator_type), joining while the app runs
    late = ray_cluster.add_node(**{**fleet_node_args("host-c"), "resources": {"host-c": 1, "accelerator_type:T4": 1}})
    try:
        ray_cluster.wait_for_nodes()
        report = {r["name"]: r for r in fleet_manager.serving().devices_report()}
        assert report["cpu:T4"]["nodes"] == ["host-c"] and report["cpu:T4"]["label"] == "T4 · 1 node(s)"
        result = fleet_manager.generate(ImageRequest(PRESET, prompt="a red circle", device="cpu:T4", precision="fp32",
                                                     mode="eager", size="64x64", steps=2), timeout=300)
        assert result.image_png.startswith(b"\x89PNG")
        (row,) = [r for r in fleet_manager.residency.status_rows() if r["state"] != "evicted"]
        assert row["node"] == "host-c" and row["chips"] == ["T4"] and row["where"] == "host-c (T4)"
    finally:
        fleet_manager.shutdown()
        ray_cluster.remove_node(late)


def test_a_tensor_parallel_engine_runs_its_ranks_on_one_node_and_leaves_nothing(cache_dir, tiny_models,
                                                                               ray_cluster):
    from ray.util import placement_group_table

    from engine.config.request import ImageRequest
    from engine.fleet.config import FleetConfig

    with engine_manager(cache_dir, fleet=FleetConfig(address=ray_cluster.address)) as m:
        result = m.generate(ImageRequest(PRESET, prompt="a red circle", device="cpu", precision="fp32", tp=2,
                                         mode="eager", size="64x64", steps=2), timeout=600)
        assert result.image_png.startswith(b"\x89PNG")
        (row,) = [r for r in m.residency.status_rows() if r["state"] != "evicted"]
        assert row["kind"] == "ray" and row["engine"].endswith("tp2") and row["node"] in ("host-a", "host-b")
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert [g["strategy"] for g in groups] == ["STRICT_PACK"] and groups[0]["bundles"] == {0: {"CPU": 2.0}}
    wait_until(lambda: not fleet_actors_alive(), 15, message="the engine actor gone")
    wait_until(lambda: not [g for g in placement_group_table().values() if g["state"] == "CREATED"], 15,
               message="the placement group removed")
    wait_until(lambda: not own_processes("engine.tp.sidecar"), 15, message="no rank left")


PUBLIC_LOCAL_START = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
import app
parser = app.build_parser()
args = parser.parse_args(["--public", "--ray", "local", "--device", "cpu", "--mode", "eager", "--warm", "none"])
engine = app.check_flags(parser, args)
hosting = app.resolve_hosting(args, engine.mode)
manager = app.build_manager(parser, args, engine, hosting)
print("DEFAULT", manager.default_key, file=sys.stderr, flush=True)
manager.shutdown()
app.leave_fleet(manager.serving())
"""


def test_public_ray_local_ignores_a_public_ray_address_and_says_one_true_thing(tmp_path):
    """Issue 50: `--public --ray local` with RAY_ADDRESS=8.8.8.8:6379 tried to join it for two minutes. Run in a
    network namespace with only loopback (`unshare -rn`): nothing could leave the machine even if it tried. Issue
    51: start-up said "no node of the Ray cluster has a device" and then "joined"; the default engine's device is
    now looked for after joining."""
    import shutil

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode:
        pytest.skip("no unprivileged network namespaces here (unshare -rn)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": "8.8.8.8:6379", "SHOWCASE_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(["unshare", "-rn", "sh", "-c", 'ip link set lo up 2>/dev/null; exec "$0" -c "$1"',
                          sys.executable, PUBLIC_LOCAL_START], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    assert sum("RAY_ADDRESS (8.8.8.8:6379) is ignored" in line for line in lines) == 1, out.stderr[-3000:]
    assert any("joined the Ray cluster at local: 1 node(s)" in line for line in lines)
    assert not any("no node of the Ray cluster" in line for line in lines), out.stderr[-3000:]
    assert any(line.startswith("DEFAULT tiny-shapes@cpu") for line in lines), out.stderr[-3000:]
