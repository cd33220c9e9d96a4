"""Build a tiny, randomly initialised Parakeet-style model offline, as a real `.nemo` file.

    .venvs/nemo/bin/python scripts/tiny_models/parakeet.py --out models/tiny/parakeet

FastConformer encoder (x8 dw_striding, 128 mel features, rel_pos attention), TDT decoder
and joint, and a SentencePiece BPE tokenizer trained with NeMo's own tooling on English
text that ships with Python. Same classes and checkpoint layout as the real checkpoints
(nvidia/parakeet-tdt-*), only ~1.6 MB. Fixed seed: the same inputs give the same weights.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

VOCAB_SIZE = 256
DURATIONS = [0, 1, 2, 3, 4]
SEED = 1234


def english_text() -> str:
    """A few pages of plain English from the standard library: no download, same on every box."""
    import argparse as ap
    import json
    import logging
    import textwrap
    import unittest

    docs = [ap.__doc__, json.__doc__, logging.__doc__, textwrap.__doc__, unittest.__doc__,
            ap.ArgumentParser.__doc__, textwrap.TextWrapper.__doc__, logging.Logger.__doc__]
    lines = [line.strip() for doc in docs if doc for line in doc.splitlines()]
    return "\n".join(line for line in lines if len(line.split()) >= 3)


def train_tokenizer(folder: Path) -> Path:
    from nemo.collections.common.tokenizers.sentencepiece_tokenizer import create_spt_model

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "text.txt"
        corpus.write_text(english_text().lower(), encoding="utf-8")
        # Also writes vocab.txt beside tokenizer.model: model init fails without it.
        create_spt_model(str(corpus), VOCAB_SIZE, sample_size=-1, do_lower_case=True,
                         tokenizer_type="bpe", output_dir=str(folder))
    return folder


def model_config(tokenizer_dir: Path) -> dict:
    d_model, hidden = 64, 64
    return {
        "sample_rate": 16000,
        "model_defaults": {"enc_hidden": d_model, "pred_hidden": hidden, "joint_hidden": hidden,
                           "tdt_durations": DURATIONS, "num_tdt_durations": len(DURATIONS)},
        "tokenizer": {"dir": str(tokenizer_dir), "type": "bpe"},
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025,
            "window_stride": 0.01, "window": "hann", "features": 128, "n_fft": 512,
            "log": True, "frame_splicing": 1, "dither": 1e-5, "pad_to": 0,
        },
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": 128, "feat_out": -1, "n_layers": 2, "d_model": d_model,
            "subsampling": "dw_striding", "subsampling_factor": 8,
            "subsampling_conv_channels": 32, "causal_downsampling": False,
            "ff_expansion_factor": 4, "self_attention_model": "rel_pos", "n_heads": 4,
            "att_context_size": [-1, -1], "att_context_style": "regular", "xscaling": True,
            "untie_biases": True, "pos_emb_max_len": 5000, "conv_kernel_size": 9,
            "conv_norm_type": "batch_norm", "conv_context_size": None,
            # Real checkpoints carry these dropouts: they make train-mode decoding random.
            "dropout": 0.1, "dropout_pre_encoder": 0.1, "dropout_emb": 0.0, "dropout_att": 0.1,
        },
        "decoder": {
            "_target_": "nemo.collections.asr.modules.RNNTDecoder",
            "normalization_mode": None, "random_state_sampling": False, "blank_as_pad": True,
            "prednet": {"pred_hidden": hidden, "pred_rnn_layers": 1, "t_max": None,
                        "dropout": 0.2},
        },
        "joint": {
            "_target_": "nemo.collections.asr.modules.RNNTJoint",
            "log_softmax": None, "preserve_memory": False, "fuse_loss_wer": True,
            "fused_batch_size": 4, "num_extra_outputs": len(DURATIONS),
            "jointnet": {"joint_hidden": hidden, "activation": "relu", "dropout": 0.2},
        },
        "decoding": {"strategy": "greedy_batch", "model_type": "tdt", "durations": DURATIONS,
                     "greedy": {"max_symbols": 10}},
        "loss": {"loss_name": "tdt",
                 "tdt_kwargs": {"fastemit_lambda": 0.0, "clamp": -1.0, "durations": DURATIONS,
                                "sigma": 0.02, "omega": 0.1}},
    }


def build(out: Path) -> Path:
    import torch
    from nemo.collections.asr.models import EncDecRNNTBPEModel
    from omegaconf import OmegaConf

    torch.manual_seed(SEED)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = train_tokenizer(Path(tmp) / "tokenizer")
        model = EncDecRNNTBPEModel(cfg=OmegaConf.create(model_config(tokenizer_dir)))
        # A random TDT joint picks blank everywhere and the text comes out empty; lowering
        # the blank logit makes the tiny model emit tokens (with timestamps) for tests.
        blank = model.tokenizer.vocab_size
        with torch.no_grad():
            model.joint.joint_net[-1].bias[blank] -= 2.0
        target = out / "parakeet-tiny.nemo"
        model.save_to(str(target))  # packs the tokenizer files into the archive
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for parakeet-tiny.nemo")
    args = parser.parse_args()
    started = time.perf_counter()
    target = build(args.out)
    size_mb = target.stat().st_size / 1e6
    print(f"wrote {target} ({size_mb:.1f} MB) in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
