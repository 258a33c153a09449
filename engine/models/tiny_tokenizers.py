"""The tiny pipelines' tokenizers (engine/models/tiny.py): a fixed English corpus, a deterministic BPE
and unigram trainer over it, and the CLIP, T5 and Qwen tokenizers built from what it learned, so a
rebuild gives the same vocabulary in every process.
"""

from __future__ import annotations

import string
from collections import Counter, defaultdict
from functools import cache
from itertools import pairwise

# Text lengths follow the real models, so each pipeline's own defaults work unchanged.
CLIP_MAX_TOKENS = 77  # as every real CLIP text encoder; the pipelines pad/truncate to this
T5_MAX_TOKENS = 512  # Flux allows max_sequence_length up to 512 (default 512; SD3 default 256)
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
