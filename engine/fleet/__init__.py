"""The fleet: engines on the machines of a Ray cluster (`app.py --ray [ADDRESS]`).

Ray places each engine, the same worker loop a worker process runs (engine/worker/loop.py), in an actor on a
node that has its device (the device spec's `ray_resource`: GPU, neuron_cores, TPU, CPU or a host-declared
resource), and Ray owns node membership, health and the actor's life. The requests do not travel through
Ray: the actor serves the worker protocol on an HMAC-authenticated socket (engine/worker/wire.py), with a
fresh token the app hands it in a method call, and the app reaches it with a ConnectionClient, so the
board, timings, progress, cancel, batching, budgets and metrics treat it like any engine (docs/multinode.md
says why and what it costs).

Modules:
- config.py    FleetConfig (what `--ray` and `--replicas` resolved to) and Placement (`@cuda:H100`,
               `@node:NAME`); the address check of `--public`. Imports no ray.
- cluster.py   joining the cluster, its nodes and what each device has on them (the device list).
- actor.py     EngineActor: the worker loop inside a Ray actor, serving one authenticated connection.
- client.py    RayClient: the app's end (place the actor, dial it, name its node when it is lost).
- replicas.py  ReplicaSet: N copies of one engine on different nodes behind one EngineClient, least-loaded.
- tp.py        a tensor-parallel engine's ranks on one node (a STRICT_PACK placement group), the actor
               relaying the app's connection to rank 0.

Layer 8, between tp and serving: it may import the contract, this folder and the layers below it (devices,
models, families, config, pipeline, worker, tp); serving imports it (EngineLauncher.make_client), lazily, only when
the app runs with `--ray`: without it nothing imports ray.

Goes here: what an engine needs to run on another machine of a Ray cluster: placement, the actor, the
connection to it and the replicas. Which engines are loaded and their budgets stay in engine/serving/.
"""
