"""Tensor-parallel launch and split checks without starting anything: argv, environment, errors.

Neuron and TPU are checked for the commands and environment they produce (no hardware here; the TPU
launch environment function is mocked). The device hooks the launch and the ranks use (launch_env,
bind_local_device through init_group, tp_load_context) are checked for every device.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from engine import devices
from engine.config.presets import get_preset
from engine.errors import InvalidRequest, UnsupportedCombination
from engine.protocol import Parallel
from engine.tp import launch, plan
from engine.tp.client import root_cause
from engine.tp.plan import TensorParallelSplitError, check_split

CACHE = Path("/srv/showcase-cache")
ROOT = Path(__file__).resolve().parent.parent


def _tail(argv: list[str]) -> list[str]:
    return argv[argv.index(launch.SIDECAR_MODULE) + 1:]


@pytest.mark.parametrize("device", ["cpu", "cuda", "xpu", "neuron", "tpu"])
def test_single_node_argv(device, monkeypatch):
    monkeypatch.setattr(torch, "tpu", types.SimpleNamespace(distributed=types.SimpleNamespace(
        set_tpu_launch_env=lambda nnodes, nproc_per_node: {})), raising=False)
    spec = devices.get_device(device)
    argv, env = launch.build_launch(spec, launch.NodeLayout(4), cache_dir=CACHE, sidecar_args=["--device", device], python="/py",
                                    base_env={})
    assert argv[:5] == ["/py", "-m", launch.TORCHRUN_MODULE, "--store-host=127.0.0.1", "--nproc-per-node=4"]
    assert "--standalone" in argv  # a private rendezvous on a free port
    assert "--max-restarts=0" in argv  # a dead rank ends the group; the app decides about restarts
    assert argv[-4:-2] == ["-m", launch.SIDECAR_MODULE] and _tail(argv) == ["--device", device]
    assert all(isinstance(a, str) for a in argv)
    assert env["PYTHONUNBUFFERED"] == "1"


def test_cpu_and_gpu_environment_sets_the_inductor_cache_before_torch_starts():
    for device in ("cpu", "cuda", "xpu"):
        _, env = launch.build_launch(devices.get_device(device), launch.NodeLayout(2), cache_dir=CACHE, base_env={})
        assert env[devices.INDUCTOR_CACHE_VAR] == str(CACHE / "inductor")
        assert devices.NEFF_CACHE_VAR not in env


def test_user_exports_win_over_defaults():
    _, env = launch.build_launch(devices.get_device("cpu"), launch.NodeLayout(2), cache_dir=CACHE,
                                 base_env={devices.INDUCTOR_CACHE_VAR: "/mine", "KEEP": "1"})
    assert env[devices.INDUCTOR_CACHE_VAR] == "/mine" and env["KEEP"] == "1"


def test_neuron_environment_keeps_compiled_neffs():
    argv, env = launch.build_launch(devices.get_device("neuron"), launch.NodeLayout(8), cache_dir=CACHE, base_env={})
    assert "--nproc-per-node=8" in argv  # one process per NeuronCore
    assert env[devices.NEFF_CACHE_VAR] == str(CACHE / "neff")
    assert devices.INDUCTOR_CACHE_VAR not in env


def test_tpu_environment_comes_from_torch_tpu_and_does_not_leak(monkeypatch):
    calls = []

    def set_tpu_launch_env(nnodes, nproc_per_node):
        calls.append((nnodes, nproc_per_node))
        os.environ["TPU_PROCESS_BOUNDS"] = f"{nproc_per_node},1,1"
        os.environ["TPU_VISIBLE_CHIPS"] = ",".join(str(i) for i in range(nproc_per_node))
        return {"TPU_PROCESS_PORT": "8476"}

    monkeypatch.setattr(torch, "tpu", types.SimpleNamespace(
        distributed=types.SimpleNamespace(set_tpu_launch_env=set_tpu_launch_env)), raising=False)
    monkeypatch.delenv("TPU_PROCESS_BOUNDS", raising=False)
    monkeypatch.delenv("TPU_VISIBLE_CHIPS", raising=False)
    before = dict(os.environ)
    argv, env = launch.build_launch(devices.get_device("tpu"), launch.NodeLayout(4), cache_dir=CACHE, base_env={},
                                    warm_modes=("defer-and-fuse",))
    assert calls == [(1, 4)]
    assert env["TPU_PROCESS_BOUNDS"] == "4,1,1" and env["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
    assert env["TPU_PROCESS_PORT"] == "8476"
    assert env[devices.TPU_DEFER_AND_FUSE_VAR] == "1"  # read once at start-up, so it goes in the environment
    assert dict(os.environ) == before  # the app's own environment is untouched
    assert "--nproc-per-node=4" in argv


def test_tpu_eager_warm_mode_starts_ranks_without_defer_and_fuse():
    env = launch.sidecar_environment(devices.get_device("tpu"), CACHE, nproc=2, warm_modes=("eager", "compile"),
                                     base={devices.TPU_DEFER_AND_FUSE_VAR: "1"}, tpu_env=lambda **kw: {})
    assert devices.TPU_DEFER_AND_FUSE_VAR not in env  # strict eager even when the parent exported it


@pytest.mark.parametrize("device", list(devices.registry()))
def test_launch_env_comes_only_from_devices_that_need_one(device):
    calls = []

    def set_env(nnodes, nproc_per_node):
        calls.append((nnodes, nproc_per_node))
        os.environ["SHOWCASE_TEST_LAUNCH_VAR"] = "set"
        return {"TPU_PROCESS_PORT": 8476}

    env = devices.get_device(device).launch_env(2, 4, set_env=set_env)
    if device == "tpu":
        assert calls == [(2, 4)] and env == {"SHOWCASE_TEST_LAUNCH_VAR": "set", "TPU_PROCESS_PORT": "8476"}
    else:
        assert calls == [] and env == {}
    assert "SHOWCASE_TEST_LAUNCH_VAR" not in os.environ
    if devices.get_device(device).tensor_parallel:
        _, launched = launch.build_launch(devices.get_device(device), launch.NodeLayout(4, 2, rdzv="10.0.0.1:29500"), cache_dir=CACHE,
                                          base_env={}, tpu_env=set_env)
        assert ("SHOWCASE_TEST_LAUNCH_VAR" in launched) is (device == "tpu")


def test_tpu_launch_env_keeps_its_old_name():
    env = launch.tpu_launch_env(1, 2, set_env=lambda nnodes, nproc_per_node: {"TPU_VISIBLE_CHIPS": "0,1"})
    assert env == {"TPU_VISIBLE_CHIPS": "0,1"}


def test_init_group_binds_the_device_through_the_spec():
    """One real gloo rank: init_group takes the device from spec.bind_local_device, the rest from the spec."""
    code = textwrap.dedent(
        """
        import json, os, socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="3")
        import torch.distributed as dist
        from engine import devices
        from engine.tp.group import init_group
        group = init_group(devices.get_device("cpu"), 60)
        try:
            print("RESULT " + json.dumps([str(group.device), group.local_rank, group.world_size,
                                          group.mesh.device_type, dist.get_backend()]))
        finally:
            dist.destroy_process_group()
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stderr[-3000:]
    assert line == 'RESULT ["cpu", 3, 1, "cpu", "gloo"]'


def test_tpu_without_torch_tpu_says_what_to_install(monkeypatch):
    monkeypatch.setattr(torch, "tpu", None, raising=False)
    with pytest.raises(UnsupportedCombination, match="torch-tpu"):
        launch.build_launch(devices.get_device("tpu"), launch.NodeLayout(2), cache_dir=CACHE, base_env={})


def test_join_timeout_reaches_the_static_rendezvous():
    argv = launch.torchrun_argv(8, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500", join_timeout=120)
    assert "--rdzv-conf=timeout=120" in argv and "--node-rank=1" in argv
    assert not any(a.startswith("--rdzv-conf") for a in launch.torchrun_argv(2))  # standalone: none
    for bad in (0, -5, "10", True, 10**9):
        with pytest.raises(InvalidRequest):
            launch.torchrun_argv(8, nnodes=2, rdzv_endpoint="h:1", join_timeout=bad)


@pytest.mark.parametrize("host", ["10.0.0.1", "gpu-a.internal", "0.0.0.0", "localhost"])
def test_listen_hosts_are_checked(host):
    assert launch.check_listen_host(host) == host


@pytest.mark.parametrize("host", ["", "a b", "$(id)", "10.0.0.1;rm", "::1", "[::1]", "http://x", "-x"])
def test_bad_listen_hosts_are_refused(host):
    with pytest.raises(InvalidRequest):
        launch.check_listen_host(host)


def test_multi_node_uses_static_rendezvous_so_rank_0_is_on_node_0():
    spec = devices.get_device("cuda")
    argv, _ = launch.build_launch(spec, launch.NodeLayout(8, 2, rdzv="10.0.0.1:29500"), cache_dir=CACHE, base_env={},
                                  sidecar_args=["--config", "/x/config.pkl", "--device", "cuda"])
    assert {"--nnodes=2", "--node-rank=0", "--rdzv-backend=static", "--rdzv-endpoint=10.0.0.1:29500"} <= set(argv)
    assert "--standalone" not in argv
    other = launch.node_command(spec, 8, 2, "10.0.0.1:29500", 1)
    assert "--node-rank=1" in other and "--nproc-per-node=8" in other
    assert _tail(other) == ["--device", "cuda"]  # no token, no config: rank 0 broadcasts the config


@pytest.mark.parametrize("endpoint", ["10.0.0.1", "host:99999", "$(reboot):1", "a b:1", "host:-1", ""])
def test_bad_rendezvous_endpoints_are_refused(endpoint):
    with pytest.raises(InvalidRequest):
        launch.build_launch(devices.get_device("cuda"), launch.NodeLayout(2, 2, rdzv=endpoint), cache_dir=CACHE, base_env={})


@pytest.mark.parametrize("kwargs", [dict(nproc=0), dict(nproc="2"), dict(nproc=2, nnodes=2),
                                    dict(nproc=2, nnodes=2, node_rank=2, rdzv_endpoint="h:1")])
def test_bad_counts_are_refused(kwargs):
    with pytest.raises(InvalidRequest):
        launch.torchrun_argv(**kwargs)


def test_user_text_stays_one_argv_element():
    prompt_like = "a; rm -rf / && echo $(id) `x` 'q'"
    argv = launch.torchrun_argv(2, sidecar_args=["--preset", prompt_like])
    assert argv[-1] == prompt_like  # a list for Popen: no shell ever parses it
    with pytest.raises(InvalidRequest):
        launch.torchrun_argv(2, sidecar_args=["a\x00b"])


def test_device_without_collectives_is_refused():
    with pytest.raises(UnsupportedCombination, match="mps"):
        launch.build_launch(devices.get_device("mps"), launch.NodeLayout(2), cache_dir=CACHE, base_env={})


def test_dist_timeout_is_longer_for_static_shape_compilers():
    assert launch.dist_timeout_s(devices.get_device("cpu")) < launch.dist_timeout_s(devices.get_device("neuron"))


# -- split checks ----------------------------------------------------------------------------------
@pytest.fixture
def checked(monkeypatch):
    """The split checks that ran to the end (each raises when the split is impossible)."""
    ran = []
    for name in ("check_transformer", "check_text_encoder"):
        real = getattr(plan, name)

        def spy(source, subfolder, cls_name, tp, real=real):
            real(source, subfolder, cls_name, tp)
            ran.append((subfolder, cls_name, tp))

        monkeypatch.setattr(plan, name, spy)
    return ran


def test_split_check_passes_for_two_ranks(tiny_models, checked):
    for preset in ("tiny-flux", "tiny-flux2-klein"):
        assert plan.check_layout_if_local(get_preset(preset), str(tiny_models[preset]), 2, Parallel.TENSOR) is True
    assert checked == [("transformer", "FluxTransformer2DModel", 2), ("transformer", "Flux2Transformer2DModel", 2)]
    check_split(get_preset("tiny-flux"), str(tiny_models["tiny-flux"]), 1)  # one rank: nothing to split
    assert len(checked) == 2


def test_split_check_names_module_and_n(tiny_models):
    with pytest.raises(TensorParallelSplitError, match=r"transformer \(FluxTransformer2DModel\) over 3 ranks.*4 attention heads"):
        check_split(get_preset("tiny-flux"), str(tiny_models["tiny-flux"]), 3)


def test_split_check_covers_the_text_encoder(tiny_models, checked):
    from dataclasses import replace

    preset = replace(get_preset("tiny-flux2-klein"), tp_text_encoder=True)
    check_split(preset, str(tiny_models["tiny-flux2-klein"]), 2)
    assert checked == [("transformer", "Flux2Transformer2DModel", 2), ("text_encoder", "Qwen3ForCausalLM", 2)]
    # The tiny Qwen3 has 2 heads: the transformer (4 heads) splits 4 ways, the text encoder does not.
    with pytest.raises(TensorParallelSplitError, match=r"text_encoder \(Qwen3ForCausalLM\) over 4 ranks"):
        check_split(preset, str(tiny_models["tiny-flux2-klein"]), 4)


def test_split_check_needs_safetensors(tiny_models, tmp_path):
    src = tiny_models["tiny-flux"]
    (tmp_path / "transformer").mkdir()
    shutil.copy(src / "model_index.json", tmp_path)
    shutil.copy(src / "transformer" / "config.json", tmp_path / "transformer")
    (tmp_path / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"")
    with pytest.raises(TensorParallelSplitError, match="safetensors"):
        check_split(get_preset("tiny-flux"), str(tmp_path), 2)


def test_preset_without_tp_plan_is_refused(tiny_models):
    with pytest.raises(TensorParallelSplitError, match="tiny-sdxl"):
        check_split(get_preset("tiny-sdxl"), str(tiny_models["tiny-sdxl"]), 2)


def test_sidecar_client_refuses_an_impossible_split_before_starting_anything(cache_dir, tiny_models):
    from engine.protocol import EngineConfig, EngineKey
    from engine.tp.client import SidecarClient

    config = EngineConfig(key=EngineKey("tiny-flux", "cpu", "fp32", 3), preset=get_preset("tiny-flux"),
                          cache_dir=str(cache_dir))
    engine = SidecarClient(config)
    with pytest.raises(TensorParallelSplitError, match="over 3 ranks"):
        engine.start()
    assert engine.process is None


# -- the by-hand entry points ----------------------------------------------------------------------
def test_sidecar_help_and_printed_command(capsys):
    from engine.tp import sidecar

    help_text = " ".join(sidecar.build_parser().format_help().split())
    assert "--rdzv-endpoint" in help_text and "--tp-address" in help_text
    assert "ranks on EACH node" in help_text and "not in all" in help_text  # --tp is per node, said plainly
    assert sidecar.main(["--device", "cuda", "--tp", "4", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29500",
                         "--preset", "flux2-dev", "--precision", "bf16", "--print-command"]) == 0
    out = capsys.readouterr().out
    assert "node 0" in out and "node 1" in out and "token" not in out
    node_1 = next(line for line in out.splitlines() if "--node-rank 1" in line).split()
    assert node_1[:3] == ["python", "-m", "engine.tp.sidecar"]  # the same one command, not a torchrun line
    for flag, value in (("--preset", "flux2-dev"), ("--precision", "bf16"), ("--device", "cuda"), ("--tp", "4"),
                        ("--nnodes", "2"), ("--rdzv-endpoint", "10.0.0.1:29500")):
        assert node_1[node_1.index(flag) + 1] == value, flag
    assert "--join-timeout" in node_1
    assert "--node-rank=0" in out and "--rdzv-conf=timeout=600" in out  # node 0's own torchrun argv


def test_root_cause_names_the_rank_that_died():
    log = """
[W] ... ChildFailedError
============================================================
engine.tp.sidecar FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2025-01-01_00:00:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2025-01-01_00:00:00
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : 4 (pid: 11)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
    # torchrun's "first observed failure" is rank 0, which only left the group: the killed rank comes first.
    assert root_cause(log) == "rank 1 was killed by SIGKILL; rank 0 left the broken group (exit code 4)"
    assert root_cause("nothing to see") is None


def test_token_and_config_files_are_private(tmp_path):
    from engine.tp.tokens import write_private

    path = write_private(tmp_path / "token", b"secret")
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_bytes() == b"secret"
