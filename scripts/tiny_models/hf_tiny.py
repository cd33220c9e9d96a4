"""Shared by the transformers tiny-checkpoint builders (qwen3.py, vibevoice.py).

- A tiny Qwen2-style byte-level BPE tokenizer trained offline: Qwen2's normaliser,
  pre-tokenizer regex and decoder, a few hundred merges instead of ~151 k. The special tokens
  follow the BPE vocabulary in the real checkpoints' order, so the relative layout matches
  (absolute ids differ: code must read them from the config/tokenizer).
- `teach`: a few dozen optimiser steps that make a tiny model answer one clip with a fixed
  text in the real output format and stop, so the worker's parsing sees realistic output.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

JFK_TEXT = ("And so, my fellow Americans, ask not what your country can do for you, "
            "ask what you can do for your country.")

# Qwen2's pre-tokenizer regex (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2 / Qwen2.5 added tokens, in vocabulary order (151643 ... 151664 in the real tokenizer).
QWEN2_ADDED_TOKENS: list[tuple[str, bool]] = [
    *[(token, True) for token in (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
        "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
        "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")],
    *[(token, False) for token in (
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")],
]

CORPUS = [
    JFK_TEXT,
    "The quick brown fox jumps over the lazy dog. Speech recognition turns spoken words into text.",
    "Ladies and gentlemen, thank you for coming. Today we talk about the weather, the city, "
    "music, silence and the people who make it work.",
    "system user assistant language English Chinese French German Spanish Korean Japanese None",
    'assistant\n[{"Start":0.0,"End":7.2,"Speaker":0,"Content":"And so, my fellow Americans,"},'
    '{"Start":7.2,"End":11.0,"Speaker":1,"Content":"ask what you can do for your country."}]',
    '[{"Start":0.52,"End":3.4,"Speaker":1,"Content":"[Music] Hello there."},'
    ' {"Start":3.4,"End":7.25,"Speaker":0,"Content":"[Silence]"}]',
    "This is a 11.00 seconds audio, please transcribe it with these keys: "
    "Start time, End time, Speaker ID, Content",
    "You are a helpful assistant that transcribes audio input into text output in JSON format.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 0.0 1.5 2.25 10.75 ! ? , . : ; ' \" [ ] { } ( )",
]


def train_bpe(merges: int = 300) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE trained on CORPUS: (vocab, merges) in the form `Qwen2Tokenizer` takes."""
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
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    model: Any = tokenizer.model
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = model.save(tmp)
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        with open(merges_file, encoding="utf-8") as f:
            pairs = [line.split() for line in f if line.strip() and not line.startswith("#")]
    return vocab, [(a, b) for a, b in pairs]  # tuples: transformers rejects merges as lists


def build_qwen2_tokenizer(extra: list[tuple[str, bool]], named: dict[str, str],
                          eos_token: str) -> Any:
    """A `Qwen2Tokenizer`: BPE, Qwen2's added tokens, then `extra` ((content, special) pairs)."""
    from transformers import AddedToken, Qwen2Tokenizer

    vocab, pairs = train_bpe()
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=pairs, unk_token=None, bos_token=None,
                               eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    for content, special in QWEN2_ADDED_TOKENS + extra:
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)],
                             special_tokens=special)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        # Reloading attaches the named tokens (eos, audio_token, ...) without changing ids.
        return Qwen2Tokenizer.from_pretrained(tmp, eos_token=eos_token, **named)


def teach(model: Any, prompt: Any, audio_embeds: Any, answer: str, tokenizer: Any,
          audio_token_id: int, steps: int) -> None:
    """Train the language model to answer `prompt` (with `audio_embeds` in its audio
    placeholders) with `answer`. The audio side is frozen: its embeddings are computed once."""
    import torch

    answer_ids = tokenizer(answer, add_special_tokens=False, return_tensors="pt")["input_ids"]
    ids = torch.cat([prompt["input_ids"], answer_ids], dim=1)
    labels = ids.clone()
    labels[:, : prompt["input_ids"].shape[1]] = -100
    audio_slots = (ids == audio_token_id).unsqueeze(-1)
    embed = model.get_input_embeddings()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        embeds = embed(ids).masked_scatter(audio_slots, audio_embeds)
        loss = model(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def run_builder(doc: str | None, build: Callable[[Path, Path | None, int], None]) -> int:
    """The command line both builders share: --out DIR [--teach CLIP [--steps N]]."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--teach", type=Path, help="JFK's clip: train the model to answer it")
    parser.add_argument("--steps", type=int, default=80, help="training steps with --teach")
    args = parser.parse_args()
    build(args.out, args.teach, args.steps)
    return 0
