"""tiny-shapes-edit's own VAE encoder: pixels to the analytic latents, so edits see where the object is.

The Kontext pipeline encodes the reference picture with the VAE's encoder. tiny-shapes' encoder only ever
served image-to-image and reads the scene poorly (its centre fields are far off), so the edit transformer
would have to localise the object itself. This stage trains the edit folder's own copy of the encoder by
regression on rendered scenes (data drawn on the fly, every prompt of the grammar, random boxes) towards
the latents of training.shapes.latents; the decoder stays tiny-shapes' own, frozen.

Every latent cell must report the object's centre and size, also the cells far from the object, so the
encoder gets `encoder_extra_blocks` more residual blocks at latent resolution (a receptive field that spans the
image); they start as identities (last convolution zero), so training starts from tiny-shapes' encoder.
The centre and size channels weigh `encoder_geometry_weight` times the others in the loss: the edit checker needs
them to about a pixel.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from training.shapes import grammar
from training.shapes import latents as semantic
from training.shapes.training import load_state, log_jsonl, lr_factor, save_state

SIZE = 64
CHECKPOINT_EVERY = 100


def deepen(vae, extra_blocks: int):
    """A copy of `vae` (AutoencoderTiny) whose encoder has `extra_blocks` more identity-initialised residual
    blocks before its last convolution; the decoder's weights are copied unchanged."""
    from diffusers import AutoencoderTiny
    from diffusers.models.unets.unet_2d_blocks import AutoencoderTinyBlock

    if extra_blocks == 0:
        return vae
    config = {k: v for k, v in vae.config.items() if k != "block_out_channels"}  # registered, not an argument
    config["num_encoder_blocks"] = (*config["num_encoder_blocks"][:-1], config["num_encoder_blocks"][-1] + extra_blocks)
    deeper = AutoencoderTiny.from_config(config)
    old = list(vae.encoder.layers)
    width = config["encoder_block_out_channels"][-1]
    added = [AutoencoderTinyBlock(width, width, config["act_fn"]) for _ in range(extra_blocks)]
    for block in added:  # conv(x) = 0, so the block is relu(x) = x on the (non-negative) features it gets
        torch.nn.init.zeros_(block.conv[-1].weight)
        torch.nn.init.zeros_(block.conv[-1].bias)
    deeper.encoder.layers = torch.nn.Sequential(*old[:-1], *added, old[-1])
    deeper.decoder.load_state_dict(vae.decoder.state_dict())
    return deeper.to(next(vae.parameters()).dtype)


def encoder_batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rendered 64x64 scenes in [-1, 1] (random prompts of the whole grammar, random boxes) and their latents."""
    prompts = grammar.all_prompts()
    chosen = [prompts[int(i)] for i in torch.randint(0, len(prompts), (n,), generator=generator)]
    return semantic.scenes(chosen, SIZE, SIZE, generator)


def channel_weights(geometry_weight: float) -> torch.Tensor:
    weights = torch.ones(semantic.CHANNELS)
    weights[2:5] = geometry_weight
    return (weights / weights.mean()).view(1, -1, 1, 1)


@torch.no_grad()
def encoder_accuracy(vae, n: int = 256, seed: int = 5) -> dict[str, float]:
    """How well the encoder reads `n` fresh scenes, read with the exact rules (training.shapes.latents.read_scene):
    the centre's error in pixels (median, mean), the side's mean error, and the share of shape codes, object
    colours and backgrounds right."""
    images, z = encoder_batch(n, torch.Generator().manual_seed(seed))
    colours, shapes, backgrounds, boxes = semantic.read_scene(vae.encode(images).latents)
    true_colours, true_shapes, true_backgrounds, true_boxes = semantic.read_scene(z)

    def centre(b):
        return b[:, :2].float() + b[:, 2:3].float() / 2

    error = (centre(boxes) - centre(true_boxes)).norm(dim=1)
    return {"centre_px_median": round(error.median().item(), 2), "centre_px_mean": round(error.mean().item(), 2),
            "side_px_mean": round((boxes[:, 2] - true_boxes[:, 2]).abs().float().mean().item(), 2),
            "shape_right": round((shapes == true_shapes).float().mean().item(), 3),
            "colour_right": round((colours == true_colours).float().mean().item(), 3),
            "background_right": round((backgrounds == true_backgrounds).float().mean().item(), 3)}


def train_encoder(vae, settings, cache: Path, minutes: float | None = None):
    """A deepened copy of `vae` (tiny-shapes' VAE) with its encoder trained by the `encoder_*` fields of
    `settings` (EditSettings), resuming from cache/encoder.ckpt. Returns (vae, finished)."""
    path = cache / "encoder.ckpt"
    steps, lr = settings.encoder_steps, settings.encoder_lr
    vae = deepen(vae, settings.encoder_extra_blocks)
    encoder = vae.encoder.train().requires_grad_(True)
    vae.decoder.requires_grad_(False)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 53)
    step, elapsed = 0, 0.0
    if (state := load_state(path)) is not None:
        encoder.load_state_dict(state["encoder"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed"]
        generator.set_state(state["generator"])
    else:
        log_jsonl(cache / "encoder-log.jsonl", {"step": 0, **encoder_accuracy(vae)})
    weights = channel_weights(settings.encoder_geometry_weight)
    started, losses = time.perf_counter(), []
    bar = tqdm(total=steps, initial=step, desc="edit encoder", dynamic_ncols=True)
    while step < steps:
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, steps, settings.encoder_warmup)
        images, z = encoder_batch(settings.encoder_batch, generator)
        loss = ((encoder(images) - z).pow(2) * weights).mean()
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(encoder.parameters(), 1.0)
        optimizer.step()
        step += 1
        losses.append(loss.item())
        bar.update(1)
        if step % CHECKPOINT_EVERY == 0 or step == steps:
            elapsed += time.perf_counter() - started
            started = time.perf_counter()
            encoder.eval()
            record = {"step": step, "loss": sum(losses) / len(losses), "minutes": round(elapsed / 60, 2),
                      **encoder_accuracy(vae)}
            encoder.train()
            losses = []
            bar.write(f"edit encoder step {step}: {record}")
            log_jsonl(cache / "encoder-log.jsonl", record)
            save_state(path, {"encoder": encoder.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                              "elapsed": elapsed, "generator": generator.get_state()})
            if minutes is not None and elapsed > minutes * 60 and step < steps:
                break
    bar.close()
    return vae.eval().requires_grad_(False), step >= steps


def load_trained(vae, settings, cache: Path):
    """The deepened `vae` with the encoder from cache/encoder.ckpt (for an export without training)."""
    state = load_state(cache / "encoder.ckpt")
    if state is None:
        raise FileNotFoundError(f"no encoder checkpoint in {cache}; train first")
    vae = deepen(vae, settings.encoder_extra_blocks)
    vae.encoder.load_state_dict(state["encoder"])
    return vae.eval().requires_grad_(False)
