"""Tensor parallel: one engine sharded over N ranks, run as a torchrun sidecar, on one machine or several.

The app starts `torchrun --nproc-per-node=N -m engine.tp.sidecar` (engine/tp/launch.py builds the argv and
environment; nothing passes through a shell), or a host starts one with `python -m engine.tp.sidecar ...`
once per node and the app attaches to it (`app.py --tp-address FILE`). Every rank loads the pipeline with the
denoiser (and, for presets with `tp_text_encoder`, the text encoder) sharded over a DeviceMesh; the other
components stay whole on each rank. Rank 0 serves the ordinary worker protocol (engine/worker/loop.py) on an
HMAC-authenticated socket (engine/worker/wire.py; loopback unless the host says `--listen`), so the sidecar
is just another ConnectionClient to the manager, the UI and the bench.

Modules:
- launch.py   pure functions: torchrun argv + environment per device (cpu/cuda/xpu/neuron/tpu), multi-node,
              and the one command each node runs.
- plan.py     up-front checks that a model can be split N ways (heads divisible, safetensors present).
- group.py    process group + DeviceMesh per device, the CPU adjustments diffusers 0.42.1 needs.
- runner.py   TensorParallelRunner: every operation (generate, warm) is broadcast by rank 0 and run in the
              same order on all ranks (collectives from two threads would deadlock).
- liveness.py heartbeats through the rendezvous store: which rank (node, host, pid) is gone.
- sidecar.py  the torchrun entry point (rank 0 + followers) and `--help`.
- nodes.py    the per-node launcher: node 0 serves, the others join; rendezvous and exit explained.
- tokens.py   the token and address files.
- client.py   SidecarClient (the app's own sidecar: launch, connect, faults, clean shutdown).
- attach.py   the app serving a sidecar it did not start: connect, errors that say what to do, re-attach.

Layer 7: it runs pipeline runners on every rank and serves them through the worker loop, and hands the
manager a ConnectionClient. It may import the contract (engine/protocol/, errors.py, metrics.py,
settings.py), this folder and the layers below it (devices, models, families, config, pipeline, worker); never
serving or bench (the manager imports SidecarClient from here, not the other way round).

Goes here: how ranks are launched, joined, watched and coordinated, for tensor and context parallel
alike. What a parallel layout needs of one pipeline's attention (a backend's context-parallel
capability) belongs to engine/pipeline/attention.py.
"""
