"""Layer 6, worker: the worker protocol's two ends, and the connections it runs over.

    loop.py         WorkerLoop and worker_main: the process that owns one engine's PipelineRunner,
                    serves its request queue (batched through engine/pipeline/batching.py) and
                    compiles buckets on a thread of its own
    served.py       what a WorkerLoop is given: EngineFacts, EngineReports, LoopPolicy (how it serves)
    serving.py      ServeCall: one pipeline call's requests run, answered and costed; RequestRecord
    client.py       EngineClient (the interface every engine is used through), EngineEvents (what an
                    engine tells its owner); ConnectionClient, the other end: submit, stream progress,
                    mirror bucket states; ProcessClient spawns a worker process (target
                    engine.worker.loop.worker_main)
    priority.py     shorter requests first where engines share the host's CPU cores
    wire.py         the protocol over a socket: authentication with a deadline, keepalive, hang-up
                    (a tensor-parallel sidecar's rank 0 serves on it; ConnectionClient hangs up with it)

The messages themselves are the contract's (engine/protocol/), so both ends, and the tensor-parallel
sidecar, speak the same typed protocol whatever carries it.

May import: the contract (engine/protocol/, errors.py, metrics.py, settings.py), this folder,
engine/devices/, engine/models/, engine/families/, engine/config/ and engine/pipeline/. Never tp, serving or bench.

Goes here: how one engine's requests are queued, ordered and answered; a new message handler; a new
transport for the protocol. How a request is computed belongs to engine/pipeline/; which engines run,
and where, to engine/serving/.
"""
