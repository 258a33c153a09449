"""Four random-weight tiny diffusers pipelines, built locally (presets with source "random:<name>").

They draw noise (the embedded default, tiny-shapes, is a trained model committed in models/), but they
let the whole app (UI, engine, compile, tensor parallel, tests) run offline on a CPU with the same loading
code as a real Hub model, for four pipeline families: each preset is built from configs, saved with
`save_pretrained` (safetensors) and loaded back with `DiffusionPipeline.from_pretrained(path)`.

- Every component is created right after `torch.manual_seed(...)` and every tokenizer is trained on the
  fixed corpus below, so a rebuild is bit-identical (same safetensors bytes).
- The VAEs have 4 blocks, so `vae_scale_factor == 8` like the real models; any multiple of 16 pixels is a
  valid height/width for all four (Flux packs 2x2 latents, SD3 has patch size 2, the SDXL UNet halves once).
- Attention head counts are even: tensor parallel over 2 ranks shards heads.
- Everything is a few MB; a 64x64 image in 4 steps takes tens of milliseconds on a CPU.
- Text lengths follow the real models (CLIP 77 tokens, T5 512, Qwen 512) so each pipeline's own defaults
  (`max_sequence_length`, `text_encoder_out_layers`) work unchanged and long prompts are truncated.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import string
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import cache
from itertools import pairwise
from pathlib import Path

import torch

from engine import settings
from engine.errors import InvalidRequest

logger = logging.getLogger(__name__)

TINY_PRESETS: tuple[str, ...] = ("tiny-flux", "tiny-flux2-klein", "tiny-sd3", "tiny-sdxl")

# Written last (inside the temporary folder, before the atomic rename): a folder without it is not a
# finished build. It records the recipe version so a stale cache can be recognised.
COMPLETE_MARKER = ".complete"
# Bump when a config below changes; an older cached build then logs a warning (delete it to rebuild).
RECIPE_VERSION = 1

# --------------------------------------------------------------------------------------------------
# Sizes. Shared by several pipelines so the same encoder is literally the same recipe everywhere.
# --------------------------------------------------------------------------------------------------
CLIP_HIDDEN = 32  # Flux: pooled_projection_dim; SD3/SDXL: two of them are concatenated
CLIP_PROJECTION = 32  # CLIPTextModelWithProjection.text_embeds (SD3 pooled, SDXL add_embedding)
CLIP_MAX_TOKENS = 77  # as every real CLIP text encoder; the pipelines pad/truncate to this
T5_D_MODEL = 64  # SD3 zero-pads the 2 x 32 CLIP features up to the T5 width, so it must be >= 64
T5_MAX_TOKENS = 512  # Flux allows max_sequence_length up to 512 (default 512; SD3 default 256)
QWEN_HIDDEN = 16  # thin, because it needs many layers (below)
QWEN_LAYERS = 27  # Flux2Klein's default text_encoder_out_layers=(9, 18, 27) reads hidden_states[27]
QWEN_OUT_LAYERS = (9, 18, 27)  # -> joint_attention_dim = 3 * QWEN_HIDDEN
QWEN_MAX_TOKENS = 512  # Flux2Klein's default max_sequence_length
VOCAB_SIZE = 1000  # per trained tokenizer (plus a few special tokens)

# --------------------------------------------------------------------------------------------------
# Corpus: a few hundred varied English sentences, generated deterministically (no randomness at all)
# from word lists, plus some hand-written ones with capitals, digits and punctuation.
# --------------------------------------------------------------------------------------------------
# fmt: off
_SUBJECTS = (
    "a red fox", "an old lighthouse", "a small robot", "the golden retriever", "a tiny cactus",
    "an astronaut", "a wooden sailboat", "the ancient castle", "a steaming cup of coffee", "a sleepy cat",
    "a mountain village", "a neon city street", "the white horse", "a paper lantern", "a glass bottle",
    "an orange tabby kitten", "a vintage bicycle", "a crowded market", "the snowy forest", "a blue whale",
    "a stone bridge", "an owl", "the desert caravan", "a bowl of ramen", "a grand piano",
)
_ACTIONS = (
    "standing on", "floating above", "hiding behind", "running across", "sleeping under",
    "glowing beside", "painted on", "reflected in", "dancing near", "waiting at",
)
_PLACES = (
    "a quiet beach at sunset", "the edge of a cliff", "a rainy window", "a field of sunflowers",
    "the surface of the moon", "a busy train station", "an underwater cave", "a misty lake",
    "a library full of books", "a frozen waterfall", "the roof of a skyscraper", "a garden in spring",
)
_STYLES = (
    "oil painting", "watercolor", "photograph, 35mm film", "digital art", "pencil sketch",
    "studio lighting, highly detailed", "isometric 3D render", "ukiyo-e woodblock print",
    "cinematic, dramatic shadows", "pixel art", "soft pastel colors", "black and white photo",
)
# fmt: on
_EXTRA = """\
The quick brown fox jumps over the lazy dog.
Pack my box with five dozen liquor jugs!
How vexingly quick daft zebras jump?
A photo of 3 cats, 2 dogs and 1 parrot sitting on a sofa.
Portrait of a woman wearing a yellow raincoat; 85mm lens, f/1.8, bokeh.
"Hello, world" written in chalk on a blackboard.
Sign that says: OPEN 24/7 (no exceptions).
It's a beautiful day -- isn't it? Let's go outside.
An illustration in the style of the 1920s, art deco, gold & black.
Close-up of a hummingbird's wing, macro photography, 4K, HDR.
Two teapots on a table: one is blue, the other is green.
Mount Fuji at dawn, cherry blossoms in the foreground.
A map of an imaginary island with rivers, towns and roads.
Minimalist poster, geometric shapes, #FF5733 and #33C1FF.
Email me at someone@example.com before 10:30am.
The year was 1999; computers were beige and loud.
Think step by step. Describe the image in detail.
You are a helpful assistant. Answer the user's question.
"""


@cache
def training_corpus() -> tuple[str, ...]:
    """~420 sentences: every subject appears with varied actions, places and styles (stride arithmetic
    instead of random choices, so the corpus never changes)."""
    lines = []
    for i in range(400):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        action = _ACTIONS[(i * 3 + i // len(_SUBJECTS)) % len(_ACTIONS)]
        place = _PLACES[(i * 7 + 1) % len(_PLACES)]
        style = _STYLES[(i * 5 + i // 7) % len(_STYLES)]
        sentence = f"{subject} {action} {place}, {style}"
        # Vary case and punctuation so capitals and sentence ends are common tokens too.
        if i % 3 == 0:
            sentence = sentence[0].upper() + sentence[1:] + "."
        elif i % 3 == 1:
            sentence = sentence.title()
        lines.append(sentence)
    lines.extend(_EXTRA.splitlines())
    return tuple(lines)


# --------------------------------------------------------------------------------------------------
# Tokenizers, trained on the corpus, then handed to the transformers v5 classes (which install the same
# normalizer/pre-tokenizer themselves from vocab + merges).
#
# Why not `tokenizers.trainers`: its BpeTrainer (with end_of_word_suffix) and UnigramTrainer give a
# different vocabulary in every process (tie-breaking follows Rust's randomly seeded HashMap; even with one
# thread), which would break bit-identical rebuilds. So the `tokenizers` library normalises and
# pre-tokenises exactly as the real tokenizer will, and the merges/scores are counted here with
# deterministic tie-breaking (highest count, then lexicographic order).
# --------------------------------------------------------------------------------------------------
def _word_counts(normalizer, pre_tokenizer) -> Counter[str]:
    words: Counter[str] = Counter()
    for line in training_corpus():
        text = normalizer.normalize_str(line) if normalizer is not None else line
        words.update(piece for piece, _ in pre_tokenizer.pre_tokenize_str(text))
    return words


def _train_bpe(words: Counter[str], num_merges: int, end_of_word_suffix: str = "") -> list[tuple[str, str]]:
    """Classic BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair), min count 2."""
    items = sorted(words.items())
    counts = [count for _, count in items]
    seqs = []
    for word, _ in items:
        symbols = list(word)
        symbols[-1] += end_of_word_suffix
        seqs.append(symbols)
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)  # pair -> words that (may) contain it
    for i, symbols in enumerate(seqs):
        for pair in pairwise(symbols):
            pair_counts[pair] += counts[i]
            where[pair].add(i)

    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges and pair_counts:
        best_count, best = min((-count, pair) for pair, count in pair_counts.items())
        if -best_count < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        for i in sorted(where.pop(best)):
            old, count = seqs[i], counts[i]
            new, j = [], 0
            while j < len(old):
                if j + 1 < len(old) and (old[j], old[j + 1]) == best:
                    new.append(joined)
                    j += 2
                else:
                    new.append(old[j])
                    j += 1
            if len(new) == len(old):
                continue
            for pair in pairwise(old):
                pair_counts[pair] -= count
                if pair_counts[pair] <= 0:
                    del pair_counts[pair]
            for pair in pairwise(new):
                pair_counts[pair] += count
                where[pair].add(i)
            seqs[i] = new
    return merges


def _byte_level_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


@cache
def _clip_vocab_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE with end_of_word_suffix "</w>", laid out like the real CLIP vocab: 256 bytes,
    256 bytes + "</w>", one token per merge, then <|startoftext|>, <|endoftext|> last."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    # The normalizer/pre-tokenizer CLIPTokenizer installs (minus its special-token alternatives).
    normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
                behavior="removed",
                invert=True,
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = _byte_level_alphabet()
    # Every byte exists with and without "</w>", or a word ending in an unseen character becomes <unk>.
    base = alphabet + [c + "</w>" for c in alphabet]
    merges = _train_bpe(
        _word_counts(normalizer, pre_tokenizer), VOCAB_SIZE - len(base) - 2, end_of_word_suffix="</w>"
    )
    vocab: dict[str, int] = {}
    for token in base + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def build_clip_tokenizer():
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab_merges()
    # merges must be a list of tuples in transformers v5 (strings "a b" are not split for this class).
    return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=CLIP_MAX_TOKENS)


@cache
def _t5_vocab() -> tuple[tuple[str, float], ...]:
    """Unigram pieces with log-probability scores and T5's ids <pad>=0, </s>=1, <unk>=2.

    Candidate pieces are printable ASCII (so capitals and punctuation never become <unk>) plus BPE merges
    over the Metaspace-split corpus; scores come from two rounds of hard EM: segment the corpus with the
    current scores (Viterbi, by the `tokenizers` Unigram model itself), re-score by usage counts."""
    import math

    from tokenizers import models, pre_tokenizers

    pre_tokenizer = pre_tokenizers.Sequence(  # what T5Tokenizer installs
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    words = _word_counts(None, pre_tokenizer)
    specials = ["<pad>", "</s>", "<unk>"]
    alphabet = sorted(set(string.printable.strip()) | {"▁"})
    merges = _train_bpe(words, VOCAB_SIZE - len(alphabet) - len(specials))
    pieces = list(dict.fromkeys(alphabet + ["".join(m) for m in merges]))

    # Start: substring frequency; unseen alphabet characters get a small floor count.
    usage = {p: 0.5 + sum(word.count(p) * n for word, n in words.items()) for p in pieces}
    for _ in range(2):
        total = sum(usage.values())
        scores = [(p, math.log(usage[p] / total)) for p in pieces]
        model = models.Unigram([("<unk>", 0.0)] + scores, unk_id=0, byte_fallback=False)
        usage = dict.fromkeys(pieces, 0.5)
        for word, n in words.items():
            for token in model.tokenize(word):
                usage[token.value] += n
    total = sum(usage.values())
    # Sentencepiece order: best score first; rounding keeps the JSON text short and stable.
    scored = sorted(
        ((p, round(math.log(usage[p] / total), 6)) for p in pieces), key=lambda ps: (-ps[1], ps[0])
    )
    return tuple([(s, 0.0) for s in specials] + scored)


def build_t5_tokenizer():
    from transformers import T5Tokenizer

    # extra_ids=0: no <extra_id_N> sentinels, an encoder-only T5 never uses them.
    return T5Tokenizer(vocab=list(_t5_vocab()), extra_ids=0, model_max_length=T5_MAX_TOKENS)


# Qwen3-style chat template, reduced to what Flux2Klein uses: user/assistant turns, a generation prompt,
# and `enable_thinking=False` pre-filling an empty <think></think> block as Qwen3 does.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
QWEN_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


@cache
def _qwen_vocab_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE like Qwen2 (no end-of-word suffix); <|endoftext|> is id 0 like Qwen2Tokenizer's own
    default."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pre_tokenizer = pre_tokenizers.Sequence(  # what Qwen2Tokenizer installs
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = _byte_level_alphabet()
    merges = _train_bpe(_word_counts(normalizers.NFC(), pre_tokenizer), VOCAB_SIZE - len(alphabet) - 1)
    vocab: dict[str, int] = {}
    # The chat tokens go right after the BPE vocab, in Qwen's order; the tokenizer class then marks them
    # special (reusing these ids) instead of appending them in its own order.
    for token in ["<|endoftext|>"] + alphabet + ["".join(m) for m in merges] + QWEN_SPECIAL_TOKENS:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def build_qwen_tokenizer():
    from transformers import Qwen2Tokenizer

    vocab, merges = _qwen_vocab_merges()
    return Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=list(merges),
        eos_token="<|im_end|>",  # as Qwen3's tokenizer; padding stays <|endoftext|>
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS),
        chat_template=QWEN_CHAT_TEMPLATE,
        model_max_length=QWEN_MAX_TOKENS,
    )


# --------------------------------------------------------------------------------------------------
# Text encoders (each seeded right before construction).
# --------------------------------------------------------------------------------------------------
def build_clip(seed: int, with_projection: bool):
    """CLIP text encoder + tokenizer. Two layers, because SD3 and SDXL read hidden_states[-2]."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = build_clip_tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=2 * CLIP_HIDDEN,
        projection_dim=CLIP_PROJECTION,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_TOKENS,
        # The pooled output is read at the first eos token; eos_token_id == 2 would switch transformers to
        # the legacy argmax(input_ids) rule, so give the real ids.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
    return model.eval(), tokenizer


def build_t5(seed: int):
    """T5 v1.1-style encoder (gated GELU) + Unigram tokenizer; relative positions, so no length limit."""
    from transformers import T5Config, T5EncoderModel

    tokenizer = build_t5_tokenizer()
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=T5_D_MODEL,
        d_kv=T5_D_MODEL // 4,
        d_ff=2 * T5_D_MODEL,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config).eval(), tokenizer


def build_qwen3(seed: int):
    """Qwen3ForCausalLM, as Flux2Klein expects. Many thin layers: the pipeline stacks hidden_states at its
    default text_encoder_out_layers (9, 18, 27), so 27 layers make the defaults work."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_qwen_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=QWEN_HIDDEN,
        intermediate_size=2 * QWEN_HIDDEN,
        num_hidden_layers=QWEN_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=QWEN_HIDDEN // 2,
        max_position_embeddings=2 * QWEN_MAX_TOKENS,
        tie_word_embeddings=True,  # the LM head is never used; tying keeps it off the disk
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval(), tokenizer


# --------------------------------------------------------------------------------------------------
# VAEs: 4 blocks -> vae_scale_factor 8, tiny widths.
# --------------------------------------------------------------------------------------------------
def build_vae(seed: int, latent_channels: int, cls=None, **extra):
    """AutoencoderKL, or a class with the same constructor such as AutoencoderKLFlux2, with 4 tiny blocks."""
    from diffusers import AutoencoderKL

    cls = cls or AutoencoderKL
    torch.manual_seed(seed)
    return cls(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=128,
        **extra,
    ).eval()


# --------------------------------------------------------------------------------------------------
# Pipelines.
# --------------------------------------------------------------------------------------------------
def _flux_dev_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1-dev / FLUX.2 scheduler config: resolution-dependent shift (the pipelines pass `mu`).
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def flux_text_encoders() -> tuple:
    """FLUX.1's text side: (CLIP, its tokenizer, T5, its tokenizer), tiny, random and seeded."""
    text_encoder, tokenizer = build_clip(seed=1, with_projection=False)
    text_encoder_2, tokenizer_2 = build_t5(seed=2)
    return text_encoder, tokenizer, text_encoder_2, tokenizer_2


def flux_pipeline(scheduler, vae, transformer, text_encoders: tuple):
    """A FluxPipeline from its parts (`text_encoders` as flux_text_encoders returns them)."""
    from diffusers import FluxPipeline

    text_encoder, tokenizer, text_encoder_2, tokenizer_2 = text_encoders
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


def _build_flux():
    from diffusers import FluxTransformer2DModel

    text_encoders = flux_text_encoders()
    # FLUX.1 latents: 16 channels, packed 2x2 -> in_channels 64; shift/scale as FLUX.1's VAE.
    vae = build_vae(
        seed=3,
        latent_channels=16,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    torch.manual_seed(4)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=T5_D_MODEL,
        pooled_projection_dim=CLIP_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # must sum to attention_head_dim
    ).eval()
    return flux_pipeline(_flux_dev_scheduler(), vae, transformer, text_encoders)


def _build_flux2_klein():
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel

    text_encoder, tokenizer = build_qwen3(seed=1)
    # AutoencoderKLFlux2 patchifies 2x2 and batch-normalises: transformer in_channels = 4 * latent_channels.
    vae = build_vae(
        seed=3, latent_channels=16, cls=AutoencoderKLFlux2, use_quant_conv=True, use_post_quant_conv=True
    )
    torch.manual_seed(4)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=len(QWEN_OUT_LAYERS) * QWEN_HIDDEN,
        axes_dims_rope=(4, 4, 4, 4),  # 4 axes (t, h, w, l), summing to attention_head_dim
        guidance_embeds=False,  # the distilled klein models take no guidance input
    ).eval()
    # is_distilled: like FLUX.2-klein-4B, no classifier-free guidance (one transformer pass per step).
    return Flux2KleinPipeline(
        scheduler=_flux_dev_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    )


def _build_sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    text_encoder, tokenizer = build_clip(seed=1, with_projection=True)
    text_encoder_2, tokenizer_2 = build_clip(seed=2, with_projection=True)
    text_encoder_3, tokenizer_3 = build_t5(seed=5)
    vae = build_vae(
        seed=3,
        latent_channels=16,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    torch.manual_seed(4)
    transformer = SD3Transformer2DModel(
        # sample_size 16 -> the pipeline's default image is 128x128 instead of 1024x1024.
        sample_size=16,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        caption_projection_dim=4 * 16,  # = inner dim
        joint_attention_dim=T5_D_MODEL,
        pooled_projection_dim=2 * CLIP_PROJECTION,  # both CLIPs' text_embeds, concatenated
        # Positional table covers latents up to 64 patches a side (1024 px); it is saved, so keep it small.
        pos_embed_max_size=64,
    ).eval()
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
        transformer=transformer,
    )


def _build_sdxl():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    text_encoder, tokenizer = build_clip(seed=1, with_projection=False)
    text_encoder_2, tokenizer_2 = build_clip(seed=2, with_projection=True)
    vae = build_vae(seed=3, latent_channels=4, scaling_factor=0.13025)
    time_embed_dim = 8
    torch.manual_seed(4)
    unet = UNet2DConditionModel(
        sample_size=16,  # default image 128x128 instead of 1024x1024
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        # diffusers' legacy name: this is the number of heads per block (SDXL: 5, 10, 20).
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 1),
        use_linear_projection=True,
        norm_num_groups=8,
        cross_attention_dim=2 * CLIP_HIDDEN,  # both CLIPs' hidden states, concatenated
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        # 6 micro-conditioning ids (original size, crop, target size) + text_encoder_2's pooled embeds.
        projection_class_embeddings_input_dim=6 * time_embed_dim + CLIP_PROJECTION,
    ).eval()
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        timestep_spacing="leading",
        steps_offset=1,
    )
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
    )


_BUILDERS: dict[str, Callable] = {
    "tiny-flux": _build_flux,
    "tiny-flux2-klein": _build_flux2_klein,
    "tiny-sd3": _build_sd3,
    "tiny-sdxl": _build_sdxl,
}
assert tuple(_BUILDERS) == TINY_PRESETS


def _check_name(name: str) -> None:
    if name not in _BUILDERS:
        raise InvalidRequest(f"Unknown tiny pipeline {name!r}; choose one of: {', '.join(TINY_PRESETS)}.")


def build_tiny_pipeline(name: str, out_dir: Path) -> None:
    """Build the tiny pipeline `name` with fixed seeds and `save_pretrained` it into `out_dir`.

    Inside a torch.distributed process group transformers writes weights on global rank 0 only, so a
    sidecar rank builds in a fresh process with no group (`python -m engine.models.tiny`)."""
    _check_name(name)
    if _in_distributed_context():
        _build_in_subprocess(name, Path(out_dir))
        return
    started = time.perf_counter()
    # The builders reseed torch before every component; fork_rng keeps the caller's RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        pipe = _BUILDERS[name]()
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    logger.info("built %s in %.1fs into %s", name, time.perf_counter() - started, out_dir)


# What makes a process part of a torchrun group (its own or one it may join).
_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")
BUILD_TIMEOUT_S = 900


def _in_distributed_context() -> bool:
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized()) or settings.torchrun_rank() is not None


def _build_in_subprocess(name: str, out_dir: Path) -> None:
    import subprocess
    import sys

    from engine.errors import ModelLoadError
    from engine.settings import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "engine.models.tiny", name, str(out_dir)], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except BaseException:
        proc.kill()  # a rank told to stop takes its builder with it
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = out.decode(errors="replace").strip().splitlines()[-5:]
        raise ModelLoadError(f"building the tiny pipeline {name} failed (exit {proc.returncode}): "
                             + " / ".join(tail))


def check_pipeline_folder(path: Path) -> str | None:
    """Why the pipeline folder `path` cannot be trusted, or None: every component that has a config.json (a
    model, not a tokenizer or scheduler) needs weight files whose safetensors headers parse and fit."""
    from engine.models.weights import CorruptWeights, read_header

    path = Path(path)
    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError) as exc:
        return f"model_index.json is missing or unreadable ({type(exc).__name__})"
    for component, spec in index.items():
        if component.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        folder = path / component
        if not folder.is_dir():
            return f"component {component} is missing"
        if not (folder / "config.json").is_file():
            continue  # a tokenizer or a scheduler: configs only
        weights = sorted(folder.glob("*.safetensors"))
        if not weights:
            return f"component {component} has no weight files"
        for index_file in folder.glob("*.safetensors.index.json"):
            try:
                shards = set(json.loads(index_file.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, AttributeError):
                return f"component {component}: {index_file.name} is unreadable"
            missing = sorted(shards - {w.name for w in weights})
            if missing:
                return f"component {component} lacks {', '.join(missing)}"
        for weight in weights:
            try:
                read_header(weight)
            except CorruptWeights as exc:
                return str(exc)
    return None


def _is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and check_pipeline_folder(path) is None


def _warn_if_stale(path: Path) -> None:
    try:
        version = json.loads((path / COMPLETE_MARKER).read_text()).get("recipe_version")
    except (OSError, ValueError, AttributeError):
        version = None
    if version != RECIPE_VERSION:
        logger.warning(
            "%s was built by tiny recipe %s, this code has %s; delete the folder to rebuild it.",
            path,
            version,
            RECIPE_VERSION,
        )


def _fallback_models_root() -> Path:
    """Where tiny models are built when the cache's models folder cannot be written: a folder of this user's
    own under the temporary directory (made 0700; one owned by anybody else is never used)."""
    root = Path(tempfile.gettempdir()) / f"diffusion-showcase-{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        info = root.lstat()
        if info.st_uid == os.getuid() and not info.st_mode & 0o022 and root.is_dir() and not root.is_symlink():
            return root / "models"
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="diffusion-showcase-")) / "models"


def ensure_tiny_pipeline(name: str, models_root: Path) -> Path:
    """Return `models_root/name`, building it first if it is missing or fails the check.

    Safe across processes: one builder at a time under an fcntl lock, the build goes into a temporary
    folder beside the target (same file system) and is renamed into place only once complete, with the
    marker file already inside. Readers therefore never see a half-written model. A folder counts as
    complete only when its marker is there and every component's weights are (check_pipeline_folder); one
    that fails is rebuilt once, with a warning. A models folder that cannot be written (read-only, full)
    falls back to a private temporary one, with a warning.
    """
    from engine.errors import ModelLoadError

    _check_name(name)
    models_root = Path(models_root)
    target = models_root / name
    if (target / COMPLETE_MARKER).is_file():  # fast path, no lock
        problem = check_pipeline_folder(target)
        if problem is None:
            _warn_if_stale(target)
            return target
        logger.warning("the tiny pipeline %s is marked complete but %s; rebuilding it", name, problem)
    try:
        return _build_locked(name, models_root)
    except OSError as exc:
        if exc.errno not in _UNWRITABLE:
            raise
        fallback = _fallback_models_root()
        logger.warning("cannot build the tiny pipeline %s in the cache's models folder (%s); building it in a "
                       "temporary folder instead: fix the cache folder or pass --cache-dir", name,
                       exc.strerror or exc)
        try:
            return _build_locked(name, fallback)
        except OSError as again:
            raise ModelLoadError(f"cannot build the tiny pipeline {name}: its cache folder is not writable "
                                 f"({exc.strerror or exc}) and neither is a temporary folder "
                                 f"({again.strerror or again}); fix the cache folder's permissions or free "
                                 "space, or pass --cache-dir") from None


_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def _build_locked(name: str, models_root: Path) -> Path:
    from engine.errors import ModelLoadError

    target = models_root / name
    if _is_complete(target):
        return target
    models_root.mkdir(parents=True, exist_ok=True)
    with open(models_root / f".{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed (also if this process dies)
        try:
            if _is_complete(target):  # another process built it while we waited
                return target
            # Leftovers of a builder that died: we hold the lock, so nobody is writing them now.
            for stale in models_root.glob(f".{name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if target.exists():  # a folder that fails the check is not trustworthy
                logger.warning("removing incomplete %s", target)
                shutil.rmtree(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_root))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the renamed model folder should not be
            try:
                build_tiny_pipeline(name, tmp)
                problem = check_pipeline_folder(tmp)
                if problem is not None:  # never mark an incomplete build complete
                    raise ModelLoadError(f"building the tiny pipeline {name} left an incomplete folder: {problem}")
                (tmp / COMPLETE_MARKER).write_text(
                    json.dumps({"name": name, "recipe_version": RECIPE_VERSION})
                )
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    logger.info("tiny pipeline %s ready at %s", name, target)
    return target


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.models.tiny NAME OUT_DIR`: build one tiny pipeline into OUT_DIR (what a sidecar rank runs)."""
    import sys
    import threading

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m engine.models.tiny NAME OUT_DIR", file=sys.stderr)
        return 2
    parent = os.getppid()

    def orphaned() -> None:  # the rank that asked is gone: stop building for nobody
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_tiny_pipeline(args[0], Path(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
