"""What every training stage of the embedded model shares: its settings, atomic checkpoints, the learning-rate schedule,
the JSONL log, and data parallelism over worker processes (spawning them, averaging their gradients).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Settings:
    seed: int = 0
    # One thread: on a shared, niced machine two OpenMP threads stall on each other's preemption.
    threads: int = 1
    processes: int = 2  # data-parallel transformer training, one thread each
    # VAE
    vae_steps: int = 3500
    vae_batch: int = 16  # at 64x64; fewer images at the larger buckets (same pixels)
    vae_lr: float = 3e-3
    vae_edge: float = 1.0
    vae_width: int = 32
    # Most of the decoder's work is at latent resolution (cheap); one block at full resolution sharpens edges.
    vae_decoder_blocks: tuple[int, int, int] = (3, 3, 1)
    vae_encoder_weight: float = 0.1
    vae_encoder_share: float = 0.25  # images of each batch the encoder trains on (it serves image-to-image)
    vae_clean_share: float = 0.25  # decoder inputs left uncorrupted
    # transformer
    depth: tuple[int, int] = (2, 2)  # double-stream, single-stream blocks
    heads: int = 2
    head_dim: int = 64
    steps: int = 3000
    tokens_per_batch: int = 4096  # image tokens: batch 64 at 64x64, 32 at 64x128, 16 at 128x128
    bucket_weights: tuple[float, ...] = (0.5, 0.2, 0.15, 0.15)  # 64x64 has the strictest target
    lr: float = 1e-3
    warmup: int = 300
    ema: float = 0.998
    discrete_sigma_share: float = 0.5
    eval_every: int = 250
    # decoder tuning on the trained transformer's own latents
    tune_steps: int = 400
    tune_lr: float = 5e-4
    tune_pool: int = 1024  # sampled latents (64x64-equivalent images), split over the buckets by weight
    tune_threads: int = 2  # the stage runs alone
    checkpoint_every: int = 250


def save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: an interrupted save never corrupts the last checkpoint


def load_state(path: Path) -> dict | None:
    return torch.load(path, weights_only=False) if path.is_file() else None


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then a cosine down to a tenth."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def log_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def spawn(worker, processes: int, args: tuple) -> None:
    """worker(rank, world, *args, store) in `processes` processes (in this one when 1)."""
    if processes == 1:
        worker(0, 1, *args, None)
        return
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, (processes, *args, Path(tmp) / "store"), nprocs=processes)


class GradientGroup:
    """Data parallelism over `world` single-threaded processes (gloo). One gradient all-reduce per step:
    on a shared, niced machine that stalls far less than two OpenMP threads syncing inside every op."""

    def __init__(self, rank: int, world: int, store: Path | None = None):
        self.rank, self.world = rank, world
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    def average_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        if self.world == 1:
            return
        import torch.distributed as dist

        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in parameters]
        )
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p in parameters:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def rank0_says(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        import torch.distributed as dist

        tensor = torch.tensor([int(flag)])
        dist.broadcast(tensor, 0)
        return bool(tensor.item())

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def training_parser(prog: str, doc: str, out: Path, cache: Path, set_example: str):
    """The flags every `python -m training.train_*` command takes: --out, --cache, --minutes and --set (the
    command adds its own --stage)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=out, help="diffusers folder to write")
    parser.add_argument("--cache", type=Path, default=cache, help="checkpoints and logs")
    parser.add_argument("--minutes", type=float, default=None,
                        help="stop (checkpointed) after this much training; rerun to resume")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                        help=f"override a training setting, e.g. {set_example}")
    return parser


def override_settings(settings, items: list[str], error) -> None:
    """`--set NAME=JSON` items applied to a settings dataclass in place (a JSON list becomes a tuple);
    `error(message)` for an unknown name (argparse's parser.error)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(settings)}
    for item in items:
        name, _, value = item.partition("=")
        if name not in names:
            error(f"unknown setting {name!r}; known: {', '.join(sorted(names))}")
        parsed = json.loads(value)
        setattr(settings, name, tuple(parsed) if isinstance(parsed, list) else parsed)


def step_and_average(optimizer, parameters, ema, ema_decay: float, step: int) -> None:
    """One optimiser step after the gradients are in (clipped to norm 1), then the EMA copy follows with the
    warm-up decay min(ema_decay, (1 + step) / (10 + step))."""
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()
    decay = min(ema_decay, (1 + step) / (10 + step))
    with torch.no_grad():
        for e, p in zip(ema.parameters(), parameters, strict=True):
            e.lerp_(p, 1 - decay)
