"""Layer 9, serving: which engines run, where, for whom, and within what budget.

    manager.py      EngineManager: validates up front, applies the host's policy, prices and routes requests,
                    reports every bucket; make_manager builds one from a command line
    hosting.py      HostingConfig (what EngineManager is built with), HostPolicy, Runtime
    flags.py        the web app's hosting flags and what they resolve to (HostingChoice, HostingConfig)
    residency.py    Residency: which engines are loaded per device, eviction, idle unload, restarts
    footprints.py   DeviceBudgets: each device's budget, measured and estimated engine footprints
    launch.py       EngineLauncher.make_client: the right client for a key and runtime, started
    policy.py       what a visitor may choose, and what the in-process runtime refuses
    admission.py    what a request costs, what each visitor holds, Generates in flight
    budget.py       memory budgets: what an engine costs, what a device may hold, whom to evict
    cost.py         token-step prices and the visitors' cost budgets
    scheduler.py    one compile scheduler per host: at most `jobs` bucket compiles at a time
    telemetry.py    Prometheus metrics of the manager's requests
    stream.py       request_events: one request as one async stream of typed events (every door reads it);
                    blocking() for synchronous readers; Run, the handle that cancels it
    inprocess.py    the in-process runtime: a WorkerLoop on threads of the app's process (ZeroGPU)
    gpu.py          GPU calls of the in-process runtime: device work inside a function ZeroGPU schedules

Every engine reaches the manager as an EngineClient (engine/worker/client.py), built by make_client and
heard through the EngineEvents it was built with: a worker process, a tensor-parallel sidecar (engine/tp/)
or an in-process engine look the same from here.

May import: the contract (engine/protocol/, errors.py, metrics.py, settings.py), this folder and
every layer below it: engine/devices/, models/, families/, config/, pipeline/, worker/, tp/ and fleet/ (fleet/ only
under --ray, lazily: it imports ray). Never bench.

Goes here: hosting policy (what visitors may choose, budgets, eviction, restarts, compile scheduling),
a new runtime that hosts engines, anything that decides between engines. How one engine serves its
queue belongs to engine/worker/; how one request is computed, to engine/pipeline/.
"""
