"""Multi-node tensor parallel on one machine standing in for two: two node launchers (`--nnodes 2`,
`--node-rank 0/1`, one gloo rank each, loopback rendezvous) serve `app.py --tp-address` like any engine.

- The image through the app's /generate equals one process running the same pipeline (<= 2/255 per pixel),
  and the app serves a single-device engine (tiny-sd3) next to it.
- A second app attaching is refused at once, a wrong token names the token file, a dead address says how
  to start the sidecar.
- Killing node 1 mid-request fails that request within seconds naming the node; the board shows the engine
  down with the reason; the app keeps serving its other engine; node 0 stops by itself.
- Started again, the sidecar is re-attached by the app; SIGTERM on node 0 leaves no process on either node.
The app is built in this process (app.attach_sidecar, what `app.py --tp-address` runs, plus the Gradio app
as tests/helpers.py builds it) and used through gradio_client's /generate and /status.
- A node that never joins: node 0 gives up after --join-timeout and says which node and what to check.
Plus unit tests of the launcher's explanations, the node checks, the heartbeats and the address file.

Run: .venv/bin/python -m pytest tests/test_tp_multinode.py -q -x   (about three minutes on two cores)
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from gradio_client import Client
from helpers import free_port, launch_demo, poll, process_gone
from PIL import Image

pytestmark = pytest.mark.slow  # starts two-node torchrun sidecars and the app

REPO = Path(__file__).resolve().parent.parent
PROMPT = "a red fox in the snow"
TP = dict(prompt=PROMPT, negative_prompt="", preset="tiny-flux", device="cpu", precision="fp32", mode="eager",
          size="64x64", steps=4, guidance=3.5, seed=7, on_cold="eager", tp="2")
SD3 = dict(TP, preset="tiny-sd3", tp="1", steps=2)
ENGINE = "tiny-flux@cpu/fp32 tp2"




class Nodes:
    """Two node launchers on this machine, as a host would start them on two."""

    def __init__(self, cache_dir: Path, folder: Path):
        self.cache_dir, self.folder = cache_dir, folder
        self.address_file = folder / "flux.json"
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}

    def command(self, node: int, port: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "engine.tp.sidecar", "--preset", "tiny-flux", "--device", "cpu", "--tp", "1",
                "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--cache-dir", str(self.cache_dir), *extra]

    def start(self, nodes=(0, 1), join_timeout: float = 120, tag: str = "", node_env=None) -> int:
        port = free_port()
        for node in nodes:
            env = {**os.environ, "SHOWCASE_CACHE_DIR": str(self.cache_dir), **((node_env or {}).get(node, {}))}
            extra = ["--join-timeout", str(join_timeout)]
            if node == 0:
                extra += ["--address-file", str(self.address_file)]
            self.logs[node] = self.folder / f"node{node}{tag}.log"
            with open(self.logs[node], "wb") as log:
                self.procs[node] = subprocess.Popen(self.command(node, port, *extra), cwd=REPO, env=env,
                                                    stdout=log, stderr=subprocess.STDOUT)
        return port

    def family(self, node: int) -> list[psutil.Process]:
        root = psutil.Process(self.procs[node].pid)
        return [root, *root.children(recursive=True)]

    def log(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _engine_row(client, engine: str = ENGINE) -> dict | None:
    return next((row for row in client.predict(api_name="/status") if row["engine"] == engine), None)


def _reference(tiny_models, request_args: dict) -> np.ndarray:
    """The same request in this one process, as the uint8 image diffusers makes of it."""
    import diffusers
    import torch

    from engine.config.presets import get_preset
    from engine.config.request import ImageRequest
    from engine.config.validation import build_request
    from engine.pipeline.runner import pipeline_call_kwargs

    preset = get_preset("tiny-flux")
    spec = ImageRequest(preset.name, prompt=request_args["prompt"], width=64, height=64,
                        steps=request_args["steps"], guidance=request_args["guidance"], seed=request_args["seed"])
    request, _ = build_request(preset, spec)
    pipe = getattr(diffusers, preset.pipeline).from_pretrained(tiny_models["tiny-flux"])
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        out = pipe(**pipeline_call_kwargs(preset, pipe, request, output_type="np"))
    return (out.images[0] * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def cluster(cache_dir, tiny_models, tmp_path_factory):
    """Two nodes, and the app attached to them the way `app.py --tp-address FILE` does it (app.attach_sidecar
    on an engine manager, the Gradio app built as helpers.launch_demo does), started together: the app comes
    up first and attaches once rank 0 listens."""
    import app as app_module
    from engine.protocol import EngineOptions
    from engine.serving.manager import EngineManager
    from ui.handlers import UIDefaults

    folder = tmp_path_factory.mktemp("multinode")
    nodes = Nodes(cache_dir, folder)
    nodes.start()
    manager = EngineManager(cache_dir=cache_dir, options=EngineOptions(warm_sizes=()))
    args = app_module.build_parser().parse_args(["--tp-address", str(nodes.address_file), "--device", "cpu"])
    attacher, _ = app_module.attach_sidecar(manager, args)
    demo, url = launch_demo(manager, UIDefaults(device="cpu", mode="eager"))
    try:
        client = Client(url, verbose=False)
        row = poll(lambda: (r := _engine_row(client)) and r["state"] == "ready" and r, 180, 0.5)
        assert row, f"not attached: {attacher.last_error}\n{nodes.log(0)[-3000:]}\n{nodes.log(1)[-2000:]}"
        yield nodes, attacher, client
    finally:
        attacher.stop()
        demo.close()
        manager.shutdown()
        nodes.stop_all()


def test_two_nodes_serve_the_app_and_match_one_process(cluster, tiny_models):
    nodes, _, client = cluster
    row = _engine_row(client)
    assert row["kind"] == "tp-sidecar" and row["attached"] and row["tp"] == 2 and row["nnodes"] == 2
    assert sorted(r["node"] for r in row["ranks"]) == [0, 1]
    started = time.monotonic()
    image_path, timings = client.predict(**TP, api_name="/generate")
    took = time.monotonic() - started
    assert timings["engine"] == ENGINE and len(timings["timings"]["step_ms"]) == 4
    image = np.asarray(Image.open(image_path).convert("RGB"))
    diff = int(np.abs(image.astype(int) - _reference(tiny_models, TP).astype(int)).max())
    print(f"two nodes through the app: {took:.1f} s, max pixel diff {diff}/255 vs one process")
    assert diff <= 2
    # The app serves its own single-device engine next to the sidecar (used again after node 1 dies).
    _, sd3 = client.predict(**SD3, api_name="/generate")
    assert sd3["engine"] == "tiny-sd3@cpu/fp32"
    token = Path(json.loads(nodes.address_file.read_text())["token_file"]).read_text().strip()
    assert token not in json.dumps(client.predict(api_name="/status"))  # never shown


# Loaded first by every process of a node (on PYTHONPATH): holds back node 0's build lock, and records who
# took it, so the rank on node 1 builds the tiny model.
_LOCK_HOOK = """
import fcntl, os, time
_flock = fcntl.flock
def _hooked(fd, op):
    number = fd if isinstance(fd, int) else fd.fileno()
    try:
        name = os.readlink(f"/proc/self/fd/{number}")
    except OSError:
        name = ""
    if op & fcntl.LOCK_EX and name.endswith(".tiny-flux.lock") and "GROUP_RANK" in os.environ:
        time.sleep(float(os.environ.get("SHOWCASE_TEST_LOCK_DELAY", "0")))
        result = _flock(fd, op)
        with open(os.environ["SHOWCASE_TEST_LOCK_LOG"], "a") as log:
            log.write(os.environ["GROUP_RANK"] + "\\n")
        return result
    return _flock(fd, op)
fcntl.flock = _hooked
"""


def test_a_model_built_by_node_1_serves_the_single_process_image(tiny_models, tmp_path):
    """Two nodes share one empty cache folder and node 1's rank wins the build lock: a rank other than global
    rank 0 used to save configs without weights (transformers saves on rank 0 only) and mark them complete."""
    from engine.config.presets import get_preset
    from engine.config.request import ImageRequest
    from engine.config.validation import build_request
    from engine.tp.attach import SidecarNotRunning, connect

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_LOCK_HOOK)
    lock_log = tmp_path / "locks.txt"
    path = os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", str(REPO))])
    env = {node: {"PYTHONPATH": path, "SHOWCASE_TEST_LOCK_LOG": str(lock_log),
                  "SHOWCASE_TEST_LOCK_DELAY": "5" if node == 0 else "0"} for node in (0, 1)}
    cache = tmp_path / "shared-cache"
    nodes = Nodes(cache, tmp_path)
    started = time.monotonic()
    nodes.start(node_env=env)
    engine = None
    try:
        def attached():
            try:
                return connect(nodes.address_file, timeout=240)
            except SidecarNotRunning:
                return None

        engine = poll(attached, 240, 1.0)
        assert engine, f"{nodes.log(0)[-3000:]}\n{nodes.log(1)[-2000:]}"
        ready_s = time.monotonic() - started
        assert lock_log.read_text().split()[0] == "1"  # node 1's rank built the model
        spec = ImageRequest("tiny-flux", prompt=TP["prompt"], width=64, height=64, steps=TP["steps"],
                            guidance=TP["guidance"], seed=TP["seed"])
        request, _ = build_request(get_preset("tiny-flux"), spec)
        result = engine.generate(request, timeout=120)
        image = np.asarray(Image.open(io.BytesIO(result.image_png)).convert("RGB"))
        diff = int(np.abs(image.astype(int) - _reference(tiny_models, TP).astype(int)).max())
        print(f"node 1 built the model: ready after {ready_s:.1f} s, max pixel diff {diff}/255 vs one process")
        assert diff <= 2
        from engine.models.tiny import check_pipeline_folder

        assert check_pipeline_folder(cache / "models" / "tiny-flux") is None
    finally:
        if engine is not None:
            engine.close()
        nodes.stop_all()


def test_app_help_names_the_flag():
    proc = subprocess.run([sys.executable, "app.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--tp-address FILE" in proc.stdout


def test_a_second_app_is_refused_and_errors_say_what_to_do(cluster, tmp_path):
    from engine.errors import EngineBusy
    from engine.tp.attach import SidecarNotRunning, SidecarTokenRefused, connect

    nodes, _, _ = cluster
    with pytest.raises(EngineBusy, match="already serves an app"):  # answered, not left in the listen backlog
        connect(nodes.address_file, timeout=10)

    info = json.loads(nodes.address_file.read_text())
    wrong = tmp_path / "wrong.token"
    wrong.write_text("0" * 64)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**info, "token_file": str(wrong)}))
    with pytest.raises(SidecarTokenRefused, match=str(wrong)):
        connect(bad, timeout=10)

    dead = tmp_path / "dead.json"
    dead.write_text(json.dumps({**info, "port": free_port()}))
    with pytest.raises(SidecarNotRunning, match=r"is not running: start it with: python -m engine.tp.sidecar .*"
                                                 r"--node-rank 0 .*; on node 1: python -m engine.tp.sidecar"):
        connect(dead, timeout=10)


def test_killing_node_1_fails_the_request_naming_the_node(cluster):
    nodes, attacher, client = cluster
    victims = nodes.family(1)
    node_0 = nodes.family(0)
    job = client.submit(**{**TP, "steps": 200, "size": "128x128"}, api_name="/generate")
    assert poll(lambda: (r := _engine_row(client)) and r["pending"] >= 1, 60, 0.1)
    time.sleep(1.0)  # inside the denoising loop
    killed_at = time.monotonic()
    for p in victims:  # the whole machine: launcher, torchrun and rank at once
        p.kill()
    with pytest.raises(Exception, match=r"rank 1 \(node 1, host [^,]+, pid \d+\) is gone") as failed:
        job.result(timeout=60)
    fail_s = time.monotonic() - killed_at
    row = poll(lambda: (r := _engine_row(client)) and r["state"] == "down" and r, 20, 0.2)
    assert row and "node 1" in row["error"] and "re-attaches" in row["error"], row
    print(f"node 1 killed: request failed after {fail_s:.2f} s: {failed.value}")
    # Node 0 stops by itself; the app keeps serving its other engine.
    assert poll(lambda: all(process_gone(p) for p in node_0), 20, 0.2), [p.cmdline() for p in node_0 if not process_gone(p)]
    assert "rank 1 (node 1" in nodes.log(0)
    _, sd3 = client.predict(**SD3, api_name="/generate")
    assert sd3["engine"] == "tiny-sd3@cpu/fp32"
    with pytest.raises(Exception, match="node 1"):  # the down engine answers with why, never a local stand-in
        client.predict(**TP, api_name="/generate")


def test_restarted_sidecar_is_reattached_and_sigterm_on_node_0_leaves_nothing(cluster):
    nodes, attacher, client = cluster
    nodes.start(tag="-again")
    row = poll(lambda: (r := _engine_row(client)) and r["state"] == "ready" and r, 150, 0.5)
    assert row, f"{client.predict(api_name='/status')}\n{nodes.log(0)[-2000:]}"
    _, timings = client.predict(**TP, api_name="/generate")
    assert timings["engine"] == ENGINE
    family = nodes.family(0) + nodes.family(1)
    assert len(family) >= 6  # per node: launcher, torchrun, rank
    stopped_at = time.monotonic()
    nodes.procs[0].send_signal(signal.SIGTERM)
    gone = poll(lambda: all(process_gone(p) for p in family), 10, 0.05)
    cleanup_s = time.monotonic() - stopped_at
    print(f"SIGTERM on node 0: every process of both nodes gone after {cleanup_s:.2f} s")
    assert gone, [(p.pid, p.cmdline()) for p in family if not process_gone(p)]
    assert nodes.procs[0].wait(5) == 0 and "stopped (SIGTERM)" in nodes.log(0)
    assert "node 1" in nodes.log(1) and "lost rank 0" in nodes.log(1)
    row = poll(lambda: (r := _engine_row(client)) and r["state"] == "down" and r, 20, 0.2)
    assert row and attacher.attaches == 2
    state = json.loads(nodes.address_file.read_text())
    assert state["state"] == "stopped" and not Path(state["token_file"]).exists()  # the token goes with it


def test_a_node_that_never_joins_times_out_naming_it(cache_dir, tiny_models, tmp_path):
    nodes = Nodes(cache_dir, tmp_path)
    started = time.monotonic()
    nodes.start(nodes=(0,), join_timeout=3)
    try:
        code = nodes.procs[0].wait(90)
    finally:
        nodes.stop_all()
    took = time.monotonic() - started
    out = nodes.log(0)
    print(f"node 1 never joined: node 0 gave up after {took:.1f} s (--join-timeout 3)")
    assert code == 6, out[-3000:]
    assert "node 1 never joined the rendezvous at 127.0.0.1:" in out and "within 3 s (--join-timeout)" in out
    assert "on node 1 run:\n    python -m engine.tp.sidecar" in out and "--node-rank 1" in out
    assert "firewall" in out
    assert json.loads(nodes.address_file.read_text())["state"] == "stopped"


# -- without starting ranks --------------------------------------------------------------------------
def _plan(*argv: str):
    from engine.tp.nodes import plan_node
    from engine.tp.sidecar import build_parser

    return plan_node(build_parser().parse_args(["--device", "cpu", "--preset", "tiny-flux", *argv]))


def test_node_rank_decides_serve_or_join(tmp_path):
    from engine.errors import InvalidRequest

    joiner = _plan("--tp", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500")
    assert "--node-rank=1" in joiner.argv and "--rdzv-conf=timeout=600" in joiner.argv
    assert "--address-file" not in joiner.argv and joiner.token_file is None  # only node 0 listens
    tail = joiner.argv[joiner.argv.index("engine.tp.sidecar") + 1:]
    assert tail[tail.index("--preset") + 1] == "tiny-flux" and tail[tail.index("--precision") + 1] == "fp32"
    server = _plan("--tp", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29500",
                   "--address-file", str(tmp_path / "a.json"))
    assert server.token_file == tmp_path / "a.token" and str(tmp_path / "a.json") in server.argv
    assert server.commands[1] == ["python", "-m", "engine.tp.sidecar", *joiner.commands[1][3:]]
    assert server.engine["tp"] == 4  # --tp is per node
    for bad in (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], ["--nnodes", "2"],
                ["--listen", "10.0.0.5"], ["--join-timeout", "0"], ["--precision", "fp64"], ["--preset", "nope"]):
        with pytest.raises(InvalidRequest):
            _plan(*bad)


def test_listen_needs_a_private_token_file(tmp_path):
    from engine.errors import InvalidRequest
    from engine.tp import tokens

    token = tmp_path / "t.token"
    assert tokens.main([str(token)]) == 0 and token.stat().st_mode & 0o777 == 0o600
    assert tokens.main([str(token)]) == 2  # never overwrites one
    plan = _plan("--listen", "10.0.0.5", "--token-file", str(token), "--address-file", str(tmp_path / "a.json"))
    assert plan.token_file == token and not plan.own_token and "--listen" in plan.argv
    token.chmod(0o644)
    with pytest.raises(InvalidRequest, match="chmod 600"):
        _plan("--listen", "10.0.0.5", "--token-file", str(token))
    short = tmp_path / "short.token"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(InvalidRequest, match="at least"):
        _plan("--listen", "10.0.0.5", "--token-file", str(short))


def test_launcher_explains_how_a_node_ended():
    from engine.tp.nodes import JOIN_TIMEOUT_EXIT, explain_exit

    plan = _plan("--tp", "1", "--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint", "10.0.0.1:29500")
    timeout = "torch.distributed.DistStoreError: Timed out after 601 seconds waiting for clients. 2/3 clients joined."
    code, text = explain_exit(plan, 1, timeout, joined={0, 1})
    assert code == JOIN_TIMEOUT_EXIT and "node 2 never joined" in text and "--node-rank 2" in text
    code, text = explain_exit(plan, 1, timeout, joined=None)
    assert code == JOIN_TIMEOUT_EXIT and "1 node(s) never joined" in text
    code, text = explain_exit(plan, 1, timeout.replace("2/3", "1/3"), joined=None)
    assert "nodes 1, 2 never joined" in text and "--node-rank 1" in text and "--node-rank 2" in text
    broken = "[tp sidecar] group broken: rank 2 (node 2, host b, pid 9) is gone (...)\n"
    assert "rank 2 (node 2, host b, pid 9) is gone" in explain_exit(plan, 1, broken)[1]
    assert explain_exit(plan, -15, "", stopped_by="SIGTERM") == (0, "node 0: stopped (SIGTERM); its ranks are gone")
    joiner = _plan("--tp", "1", "--nnodes", "3", "--node-rank", "2", "--rdzv-endpoint", "10.0.0.1:29500")
    unreachable = ("torch.distributed.DistNetworkError: The client socket has timed out after 600000ms while "
                   "trying to connect to (10.0.0.1, 29500).")
    code, text = explain_exit(joiner, 1, unreachable)
    assert code == JOIN_TIMEOUT_EXIT and "could not reach node 0's rendezvous at 10.0.0.1:29500" in text
    code, text = explain_exit(joiner, 1, "DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed.")
    assert "node 0 stopped or gave up waiting for another node" in text


def test_nodes_started_for_another_engine_are_told_so(monkeypatch):
    from engine.config.presets import get_preset
    from engine.protocol import EngineConfig, EngineKey
    from engine.tp.sidecar import _node_claims, build_parser

    config = EngineConfig(key=EngineKey("tiny-flux", "cpu", "fp32", 2), preset=get_preset("tiny-flux"))
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")

    def claims(*argv):
        return _node_claims(build_parser().parse_args(["--device", "cpu", *argv]), config, {"local_world": 1})

    assert claims("--preset", "tiny-flux", "--precision", "FP32") is None
    assert claims() is None  # a rank started without claims (the app's own node command) is not judged
    assert "--preset tiny-sd3 but node 0 serves tiny-flux" in claims("--preset", "tiny-sd3")
    assert "--precision bf16 but node 0 serves fp32" in claims("--precision", "bf16")
    assert "runs 1 ranks but node 0 runs 2" in _node_claims(build_parser().parse_args([]), config, {"local_world": 2})
    monkeypatch.setenv("GROUP_RANK", "0")
    assert claims("--preset", "tiny-sd3") is None  # node 0 is the reference


class _FakeStore:
    def __init__(self):
        self.counts: dict[str, int] = {}

    def add(self, key, n):
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]


def test_heartbeats_name_the_silent_rank():
    from engine.tp.liveness import Liveness, describe_rank

    store = _FakeStore()
    beating = [Liveness(r, 3, store_factory=lambda: store, beat_s=0.05).start() for r in (0, 2)]
    watcher = Liveness(0, 3, node_timeout_s=0.5, store_factory=lambda: store, beat_s=0.05)
    try:
        assert watcher.silent_ranks() == [1]  # rank 1 never beat
        seen = []
        watcher.watch(lambda ranks, s: seen.append((ranks, s)), interval_s=0.05)
        assert poll(lambda: seen, 5, 0.05) and seen[0][0] == [1] and seen[0][1] >= 0.5
        ranks = [{"rank": 1, "node": 1, "host": "gpu-b", "pid": 42}]
        assert describe_rank(ranks, 1) == "rank 1 (node 1, host gpu-b, pid 42)"
        lost = []
        follower = Liveness(1, 3, node_timeout_s=0.3, store_factory=lambda: 1 / 0, beat_s=0.05)
        follower.start(on_store_lost=lost.append)
        assert poll(lambda: lost, 5, 0.05)  # a follower that cannot reach node 0's store gives up
    finally:
        for beat in beating:
            beat.stop()
        watcher.stop()


def test_address_file_problems_say_what_to_do(tmp_path):
    from engine.tp.attach import SidecarNotRunning, SidecarTokenRefused, dial_sidecar
    from engine.tp.tokens import update_address, write_private

    address = tmp_path / "tp.json"
    with pytest.raises(SidecarNotRunning, match="--address-file"):
        dial_sidecar(address)
    update_address(address, state="starting", command=["python", "-m", "engine.tp.sidecar", "--node-rank", "0"])
    with pytest.raises(SidecarNotRunning, match="is starting"):
        dial_sidecar(address)
    port = free_port()
    update_address(address, state="stopped", host="127.0.0.1", port=port, token_file=str(tmp_path / "tp.token"),
                   reason="node 0: stopped (SIGTERM)")
    with pytest.raises(SidecarNotRunning, match=rf"127.0.0.1:{port} is not running \(it stopped: node 0: stopped "
                                                 r"\(SIGTERM\)\): start it with: python -m engine.tp.sidecar --node-rank 0"):
        dial_sidecar(address)
    update_address(address, state="listening")  # a launcher killed with SIGKILL leaves "listening" behind
    with pytest.raises(SidecarTokenRefused, match="tp.token"):  # ... and no token file
        dial_sidecar(address)
    write_private(tmp_path / "tp.token", b"f" * 64)
    with pytest.raises(SidecarNotRunning, match=rf"127.0.0.1:{port} is not running: start it with: python -m "
                                                 r"engine.tp.sidecar --node-rank 0"):
        dial_sidecar(address)
    # Copied to the app's machine: the token file is looked for next to the address file.
    other = tmp_path / "copy"
    other.mkdir()
    shutil.copy(tmp_path / "tp.token", other / "tp.token")
    update_address(other / "tp.json", host="127.0.0.1", port=port, token_file="/elsewhere/tp.token", state="listening")
    with pytest.raises(SidecarNotRunning, match="is not running"):  # got past the token: found next to it
        dial_sidecar(other / "tp.json")
