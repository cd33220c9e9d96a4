"""A tiny Qwen2-style byte-level BPE tokenizer, trained offline, for the tiny test checkpoints.

Same normaliser, pre-tokenizer regex and decoder as Qwen2's; a few hundred merges instead of
~151 k. The special tokens follow the BPE vocabulary in the real checkpoints' order, so the
relative layout matches (absolute ids differ: code must read them from config/tokenizer).
"""

from __future__ import annotations

import tempfile
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2's pre-tokenizer regex (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2 / Qwen2.5 added tokens, in vocabulary order (151643 ... 151664 in the real tokenizer).
QWEN2_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
QWEN2_PLAIN_TOKENS = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]

CORPUS = [
    "And so, my fellow Americans, ask not what your country can do for you, "
    "ask what you can do for your country.",
    "The quick brown fox jumps over the lazy dog. Speech recognition turns spoken words into text.",
    "Ladies and gentlemen, thank you for coming. Today we talk about the weather, the city, "
    "music, silence and the people who make it work.",
    "system user assistant language English Chinese French German Spanish Korean Japanese None",
    'assistant\n[{"Start":0.0,"End":11.0,"Speaker":0,"Content":"And so, my fellow Americans."}]',
    '[{"Start":0.52,"End":3.4,"Speaker":1,"Content":"[Music] Hello there."},'
    ' {"Start":3.4,"End":7.25,"Speaker":0,"Content":"[Silence]"}]',
    "This is a 11.00 seconds audio, please transcribe it with these keys: "
    "Start time, End time, Speaker ID, Content",
    "You are a helpful assistant that transcribes audio input into text output in JSON format.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 0.0 1.5 2.25 10.75 ! ? , . : ; ' \" [ ] { } ( )",
]


def train_bpe(merges: int = 300, corpus: list[str] | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train byte-level BPE: returns (vocab, merges) in the form `Qwen2Tokenizer` takes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + merges, initial_alphabet=alphabet, min_frequency=1,
        show_progress=False, special_tokens=[],
    )
    tokenizer.train_from_iterator((corpus or CORPUS) * 4, trainer=trainer)
    model: Any = tokenizer.model
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = model.save(tmp)
        import json

        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        with open(merges_file, encoding="utf-8") as f:
            pairs = [line.split() for line in f if line.strip() and not line.startswith("#")]
    return vocab, [(a, b) for a, b in pairs]


def build_qwen2_tokenizer(extra: list[tuple[str, bool]], named: dict[str, str], eos_token: str,
                          merges: int = 300) -> Any:
    """A `Qwen2Tokenizer` with the Qwen2 added tokens, then `extra` ((content, special) pairs)."""
    from transformers import AddedToken, Qwen2Tokenizer

    vocab, pairs = train_bpe(merges)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=pairs, unk_token=None, bos_token=None,
                               eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    ordered = [(t, True) for t in QWEN2_SPECIAL_TOKENS] + [(t, False) for t in QWEN2_PLAIN_TOKENS]
    ordered += extra
    for content, special in ordered:
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)],
                             special_tokens=special)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        # Reloading attaches the named tokens (eos, audio_token, ...) without changing ids.
        return Qwen2Tokenizer.from_pretrained(tmp, eos_token=eos_token, **named)
