"""Tensor parallel: one engine sharded over N ranks, run as a torchrun sidecar.

The app starts `torchrun --nproc-per-node=N -m engine.tp.sidecar` (engine/tp/launch.py builds the argv and
environment; nothing passes through a shell). Every rank loads the pipeline with the denoiser (and, for
presets with `tp_text_encoder`, the text encoder) sharded over a DeviceMesh; the other components stay whole
on each rank. Rank 0 serves the ordinary worker protocol (engine/worker.py) on an HMAC-authenticated loopback
socket, so `engine.tp.client.SidecarEngine` is just another ConnectionEngine to the manager, the UI and the
bench.

Modules:
- launch.py  pure functions: torchrun argv + environment per device (cpu/cuda/xpu/neuron/tpu), multi-node.
- plan.py    up-front checks that a model can be split N ways (heads divisible, safetensors present).
- group.py   process group + DeviceMesh per device, the CPU adjustments diffusers 0.42.1 needs.
- runner.py  TensorParallelRunner: every operation (generate, warm) is broadcast by rank 0 and run in the
             same order on all ranks (collectives from two threads would deadlock).
- sidecar.py the torchrun entry point (rank 0 + followers) and the by-hand launcher (`--help`).
- client.py  SidecarEngine (launch, connect, fault reporting, clean shutdown) and `connect()`.
"""
