"""Benchmark: what each mode and precision buys, measured side by side in one run.

`python -m bench bench` measures every (precision, mode, size) configuration of one model in one
process, so the ratios compare numbers taken on the same machine in the same minutes. It prints a
Markdown table and a list of ratios against their targets (a target the code does not reach is
printed as MISSED, never hidden), and writes `bench.json`, `bench.md` and `bench.png` to `--out`.

Two kinds of run:

* pipeline (default, pipeline.py): the real engine path, with the engine overhead (engine request vs
  a bare diffusers call) and the persistent compile cache (cache_probe.py: cold vs filled cache in
  fresh child processes) measured too.
* denoiser (`--random-weights`, denoiser.py): the preset's real denoiser architecture with random
  weights, fed random inputs of the bucket's shapes (denoiser_shapes.py: per pipeline, an edit's
  references and a clip's frames included). No download, real shapes: the GPU run.

The rest: modes.py (the bench's mode vocabulary), plan.py (a run as data, from the command line),
cli.py (the sub-command's parser), run.py (plan -> measure -> report), stats.py (statistics, speedup
table, ratios, targets), report.py (Markdown, bench.json, chart), measure.py (what the measuring
paths share).

Beside the benchmark, the commands that measure a whole host from outside: soak.py (`python -m bench
soak`: simulated visitors against a real app process, memory and orphans checked) and load.py
(`python -m bench load`: a burst of visitors at one bucket, batching off and on). The
advisor (advise.py), the contention and context-parallel benches, a video VAE's decode plain against tiled
(vae_decode.py, `vae-bench`) and the cold-start probe live here too;
`python -m bench --help` lists every command (commands.py).

A package of its own, above the engine: the engine never imports it. It drives the engine through its
public interfaces: the manager (engine/serving/), the client (engine/worker/client.py, the in-process
runtime engine/serving/inprocess.py), the configuration (engine/config/), the devices, the contract and the
levers' vocabularies (engine/pipeline/stepcache.py, attention.py, memory.py). A few modules measure the
runner or a layer's internals themselves and are named, each with its reason, in tests/test_import_graph.py
(BENCH_INTERNALS). It may import the training package's checker (training/shapes/); the UI and app.py may
import it. A new measurement, a new probe of a lever (step caches, quantization, batching) goes here; the
lever itself goes where it runs (engine/pipeline/ for a pipeline's levers).

Importing this package imports no torch (commands.py registers the parser for every sub-command, and the
UI's Compare tab uses the pure statistics): only what runs a measurement imports it.
"""

from bench.cli import add_bench_parser, cmd_bench
from bench.modes import BASELINE_MODE, BENCH_MODES, COMPILED_MODES, MODE_TABLE
from bench.report import machine_info, markdown_report, markdown_table, markdown_targets, write_outputs
from bench.stats import (
    RESULT_FIELDS,
    TARGETS,
    Target,
    compute_ratios,
    evaluate_targets,
    median,
    p90,
    speedup_table,
)

__all__ = [
    "BASELINE_MODE",
    "BENCH_MODES",
    "COMPILED_MODES",
    "MODE_TABLE",
    "RESULT_FIELDS",
    "TARGETS",
    "Target",
    "add_bench_parser",
    "cmd_bench",
    "compute_ratios",
    "evaluate_targets",
    "machine_info",
    "markdown_report",
    "markdown_table",
    "markdown_targets",
    "median",
    "p90",
    "speedup_table",
    "write_outputs",
]
