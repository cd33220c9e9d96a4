"""A tiny, randomly initialised pyannote.audio speaker-diarization pipeline, in the layout of
pyannote/speaker-diarization-community-1 (pyannote.audio 4):

    config.yaml                      the pipeline: SpeakerDiarization, $model/ subfolders, VBx
    segmentation/pytorch_model.bin   PyanNet, powerset (3 speakers, 2 at once), 10 s chunks
    embedding/pytorch_model.bin      WeSpeakerResNet34 (its size is fixed: ~26 MB)
    plda/xvec_transform.npz          x-vector centring + LDA
    plda/plda.npz                    PLDA (mu, tr, psi)

Each checkpoint is the dictionary Lightning writes (state_dict, hyper_parameters, the
"pyannote.audio" block that `Model.on_save_checkpoint` adds), so `Pipeline.from_pretrained(DIR)`
loads it as it loads the real one. The segmentation's last bias favours "one speaker" so the
random model still finds speech. Run with the pyannote environment's Python:

    .venvs/pyannote/bin/python scripts/tiny_models/pyannote_pipeline.py --out models/tiny/pyannote
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

CONFIG = """\
dependencies:
  pyannote.audio: {version}
pipeline:
  name: pyannote.audio.pipelines.SpeakerDiarization
  params:
    clustering: VBxClustering
    embedding: $model/embedding
    embedding_batch_size: 8
    embedding_exclude_overlap: true
    plda: $model/plda
    segmentation: $model/segmentation
    segmentation_batch_size: 8
params:
  clustering:
    threshold: 0.6
    Fa: 0.07
    Fb: 0.8
  segmentation:
    min_duration_off: 0.0
"""
LDA_DIMENSION = 16


def checkpoint(model: torch.nn.Module, version: str) -> dict:
    """What Lightning's ModelCheckpoint saves for a pyannote Model."""
    import pytorch_lightning

    return {
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
        "pytorch-lightning_version": pytorch_lightning.__version__,
        "pyannote.audio": {
            "versions": {"pyannote.audio": version},
            "architecture": {"module": type(model).__module__, "class": type(model).__name__},
            "specifications": model.specifications,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import pyannote.audio
    from pyannote.audio.core.task import Problem, Resolution, Specifications
    from pyannote.audio.models.embedding import WeSpeakerResNet34
    from pyannote.audio.models.segmentation import PyanNet

    torch.manual_seed(0)
    version = pyannote.audio.__version__
    segmentation = PyanNet(sincnet={"stride": 10},
                           lstm={"hidden_size": 16, "num_layers": 1, "bidirectional": True},
                           linear={"hidden_size": 16, "num_layers": 1})
    segmentation.specifications = Specifications(
        problem=Problem.MONO_LABEL_CLASSIFICATION, resolution=Resolution.FRAME, duration=10.0,
        classes=["speaker#1", "speaker#2", "speaker#3"], powerset_max_classes=2,
        permutation_invariant=True)
    segmentation.build()
    with torch.no_grad():  # powerset classes: {}, {1}, {2}, {3}, {1,2}, …: speech, one voice
        segmentation.classifier.bias[:] = torch.tensor([0.0, 3.0, 2.0, 1.0, -3, -3, -3])
    embedding = WeSpeakerResNet34()
    embedding.specifications = Specifications(
        problem=Problem.REPRESENTATION, resolution=Resolution.CHUNK, duration=10.0,
        min_duration=0.5)
    for name, model in (("segmentation", segmentation), ("embedding", embedding)):
        (args.out / name).mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint(model.eval(), version), args.out / name / "pytorch_model.bin")
    rng = np.random.default_rng(0)
    dimension = 256  # WeSpeakerResNet34's embedding
    plda = args.out / "plda"
    plda.mkdir(exist_ok=True)
    lda = np.linalg.qr(rng.standard_normal((dimension, LDA_DIMENSION)))[0]
    np.savez(plda / "xvec_transform.npz", mean1=np.zeros(dimension), mean2=np.zeros(LDA_DIMENSION),
             lda=lda)
    np.savez(plda / "plda.npz", mu=np.zeros(LDA_DIMENSION), tr=np.eye(LDA_DIMENSION),
             psi=np.linspace(2.0, 0.5, LDA_DIMENSION))
    (args.out / "config.yaml").write_text(CONFIG.format(version=version))


if __name__ == "__main__":
    main()
