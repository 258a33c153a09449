"""Layer 7, serving: which engines run, where, for whom, and within what budget.

    manager.py      EngineManager: one engine per (model, device, precision, tp), started on demand;
                    validates up front, applies the host's policy, routes requests, restarts engines,
                    reports every bucket; make_manager builds one from a command line
    budget.py       memory budgets: what an engine costs, what a device may hold, whom to evict
    scheduler.py    one compile scheduler per host: at most `jobs` bucket compiles at a time
    inprocess.py    the in-process runtime: a WorkerLoop on threads of the app's process (ZeroGPU)
    gpu.py          GPU calls of the in-process runtime: device work inside a function ZeroGPU schedules

Every engine reaches the manager as a ConnectionClient (engine/worker/client.py): a worker process, a
tensor-parallel sidecar (engine/tp/) or an in-process engine look the same from here.

May import: the contract (engine/protocol.py, errors.py, metrics.py, settings.py), this folder and
every layer below it: engine/devices/, models/, config/, pipeline/, worker/ and tp/. Never bench.

Goes here: hosting policy (what visitors may choose, budgets, eviction, restarts, compile scheduling),
a new runtime that hosts engines, anything that decides between engines. How one engine serves its
queue belongs to engine/worker/; how one request is computed, to engine/pipeline/.
"""
