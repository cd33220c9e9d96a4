"""Build a tiny, randomly initialised XTTS v2 checkpoint in the real layout, offline.

    .venvs/xtts/bin/python scripts/tiny_models/xtts.py --out models/tiny/xtts

Writes config.json, model.pth ({"model": state_dict}, fp16), vocab.json (a `tokenizers`
BPE with XTTS's special tokens and language tags) and speakers_xtts.pth (built-in
speakers' conditioning latents). It speaks noise, but every production call runs on it.
The HiFiGAN decoder and speaker encoder keep their full (hard-coded) size: ~51 MB.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from TTS.tts.configs.xtts_config import XttsConfig
from TTS.tts.models.xtts import Xtts

VOCAB_SIZE = 512
# Names of real XTTS v2 built-in speakers, so tests and configs look like production ones.
SPEAKERS = ("Claribel Dervla", "Ana Florence")
LANGUAGES = XttsConfig().languages

# Characters the XTTS text cleaners can leave (zh, ja and ko are romanised before tokenising).
ALPHABET = (
    "abcdefghijklmnopqrstuvwxyz0123456789.,!?;:'-()"
    "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßąćęłńśźżčďěňřšťůžğışőű"
    + "".join(chr(c) for c in range(0x430, 0x450))  # Cyrillic U+0430..U+044F
    + "ё"
    + "".join(chr(c) for c in range(0x621, 0x653))  # Arabic letters and harakat
    + "".join(chr(c) for c in range(0x901, 0x94E))  # Devanagari
)

CORPUS = [
    "and so, my fellow americans: ask not what your country can do for you, "
    "ask what you can do for your country.",
    "the quick brown fox jumps over the lazy dog while the weather stays fine today.",
    "hello world. this is a test of the speech gateway, spoken by a very small model.",
    "please leave a message after the tone, and we will call you back as soon as we can.",
    "there is nothing either good or bad, but thinking makes it so.",
    "el rápido zorro marrón salta sobre el perro perezoso. ¿qué tal estás hoy?",
    "le renard brun rapide saute par-dessus le chien paresseux. bonjour à tous!",
    "der schnelle braune fuchs springt über den faulen hund. guten morgen!",
    "la volpe marrone veloce salta sopra il cane pigro. buongiorno a tutti.",
    "a rápida raposa marrom pula sobre o cão preguiçoso. bom dia!",
    "szybki brązowy lis przeskakuje nad leniwym psem. dzień dobry.",
    "hızlı kahverengi tilki tembel köpeğin üzerinden atlar. günaydın.",  # noqa: RUF001
    "быстрая коричневая лиса перепрыгивает через ленивую собаку.",
    "de snelle bruine vos springt over de luie hond. goedemorgen.",
    "příliš žluťoučký kůň úpěl ďábelské ódy. dobré ráno.",
    "الثعلب البني السريع يقفز فوق الكلب الكسول",
    "ni3 hao3 shi4 jie4. jin1 tian1 tian1 qi4 hen3 hao3.",
    "a gyors barna róka átugrik a lusta kutya felett.",
    "annyeonghaseyo. oneul nalssiga jonneyo.",
    "konnichiha sekai. kyou ha ii tenki desu ne.",
    "तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है",
]


def build_vocab(path: Path) -> Tokenizer:
    """A BPE like XTTS's: [STOP]=0, [UNK], [SPACE], merges, then [START] and language tags."""
    late_tokens = ["[START]", *(f"[{lang}]" for lang in LANGUAGES)]
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(late_tokens),
        special_tokens=["[STOP]", "[UNK]", "[SPACE]"],
        initial_alphabet=sorted(set(ALPHABET)),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.add_special_tokens(late_tokens)
    tokenizer.save(str(path))
    return tokenizer


def build_config(tokenizer: Tokenizer) -> XttsConfig:
    config = XttsConfig()
    # Inference settings of the released XTTS v2 config.json.
    config.temperature = 0.75
    config.repetition_penalty = 5.0
    config.gpt_cond_len = 30
    config.gpt_cond_chunk_len = 4
    config.max_ref_len = 30
    args = config.model_args
    args.gpt_layers = 2
    args.gpt_n_model_channels = 128
    args.gpt_n_heads = 4
    args.decoder_input_dim = 128  # the HiFiGAN decoder reads GPT latents: equal to GPT width
    args.d_vector_dim = 512
    args.gpt_num_audio_tokens = 1026
    args.gpt_start_audio_token = 1024
    args.gpt_stop_audio_token = 1025
    # A random GPT rarely emits the stop token: this bounds each sentence to ~1 s of audio.
    args.gpt_max_audio_tokens = 24
    args.gpt_max_text_tokens = 402
    args.gpt_max_prompt_tokens = 70
    args.gpt_use_perceiver_resampler = True
    args.gpt_use_masking_gt_prompt_approach = True
    args.gpt_number_text_tokens = max(tokenizer.get_vocab().values()) + 1
    args.gpt_start_text_token = tokenizer.token_to_id("[START]")
    args.gpt_stop_text_token = tokenizer.token_to_id("[STOP]")
    return config


def synthetic_voice(f0: float, seconds: float, rate: int, rng: np.random.Generator) -> np.ndarray:
    """A buzzy harmonic tone with vibrato and breath noise: enough to condition on."""
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.03 * np.sin(2 * np.pi * 5 * t))) / rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 2.5 * t) ** 2
    audio = envelope * wave + 0.05 * rng.standard_normal(t.size)
    return (0.5 * audio / np.abs(audio).max()).astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_vocab(args.out / "vocab.json")
    config = build_config(tokenizer)
    config.save_json(str(args.out / "config.json"))
    model = Xtts(config)
    state = {
        key: value.half() if value.is_floating_point() else value
        for key, value in model.state_dict().items()
    }
    torch.save({"model": state}, args.out / "model.pth")

    model.eval()
    rate = config.audio.sample_rate
    speakers = {}
    for index, name in enumerate(SPEAKERS):
        audio = torch.from_numpy(synthetic_voice(110.0 + 90.0 * index, 6.0, rate, rng))[None]
        # Key order matters: Xtts.synthesize unpacks `.values()` as (latent, embedding).
        speakers[name] = {
            "gpt_cond_latent": model.get_gpt_cond_latents(
                audio, rate, length=config.gpt_cond_len, chunk_length=config.gpt_cond_chunk_len
            ).contiguous(),
            "speaker_embedding": model.get_speaker_embedding(audio, rate).contiguous(),
        }
    torch.save(speakers, args.out / "speakers_xtts.pth")

    size = sum(p.stat().st_size for p in args.out.iterdir()) / 1e6
    print(
        f"tiny xtts: {args.out} ({size:.1f} MB, {tokenizer.get_vocab_size()} tokens, "
        f"speakers {', '.join(SPEAKERS)}) in {time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
