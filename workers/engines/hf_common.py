"""What the transformers ASR engines (qwen3, vibevoice) share: load on one device, generate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.settings import Settings
from workers.engines.base import ModelRef


@dataclass(slots=True)
class HfHandle:
    processor: Any
    model: Any


class HfAsrEngine:
    """What qwen3 and vibevoice share; each adds `sample_rate`, `load`, `warm_up` and
    `transcribe`."""

    name = ""
    uses_torch = True
    segment_separator = " "

    def __init__(self, settings: Settings) -> None:
        self.settings = settings  # no option of these engines comes from the settings yet

    def cuda_available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def unload(self, handle: HfHandle) -> None:
        """Nothing engine-specific: the runtime drops the handle and frees torch's cache."""

    def check_source(self, model: ModelRef) -> None:
        check_source(model.source)

    def check_task(self, task: str) -> None:
        if task != "transcribe":
            raise ValueError(f"{self.name} does not support task={task!r}")


def check_source(source: str) -> None:
    """Fail clearly on a missing local checkpoint instead of letting it be tried as a hub id."""
    path = Path(source).expanduser()
    looks_local = path.exists() or source.startswith(("/", ".", "~")) or source.count("/") > 1
    if looks_local and not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model checkpoint (config.json) in directory {source!r}")


def load(model_class: Any, source: str, device: str, attn_implementation: Any = "sdpa") -> HfHandle:
    """Processor + model from a directory or hub id (hub cache under HF_HOME), ready to generate."""
    import torch
    from transformers import AutoConfig, AutoProcessor

    check_source(source)
    config = AutoConfig.from_pretrained(source)
    expected = model_class.config_class.model_type
    if config.model_type != expected:
        # from_pretrained would only warn, and build a model of random weights.
        raise ValueError(f"{source!r} holds a {config.model_type!r} checkpoint, not {expected!r}")
    # bf16 on CPU is several times slower than fp32 (no bf16 kernels on most CPUs).
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    processor = AutoProcessor.from_pretrained(source)
    # A single-device map: sharding across GPUs breaks these models.
    model = model_class.from_pretrained(
        source, config=config, dtype=dtype, attn_implementation=attn_implementation,
        device_map={"": device},
    )
    model.eval()
    # Every call passes max_new_tokens; a max_length in the checkpoint's generation config
    # (VibeVoice ships 32768) would only make generate() warn on each request.
    model.generation_config.max_length = None
    return HfHandle(processor, model)


def generate(handle: HfHandle, inputs: Any, max_new_tokens: int, **kwargs: Any) -> str:
    """Greedy decoding of one prepared request; returns the new text without special tokens.

    Pass `inputs` without keeping a reference to it: its tensors then go with this call.
    """
    import torch

    model = handle.model
    try:
        inputs = inputs.to(model.device, model.dtype)
        prompt_length = inputs["input_ids"].shape[1]
        with torch.inference_mode():
            output = model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs
            )
        new_ids = output[0, prompt_length:].tolist()
        del output
    finally:
        del inputs
    return handle.processor.decode(new_ids, skip_special_tokens=True)


def generate_batch(handle: HfHandle, inputs: Any, max_new_tokens: list[int]) -> list[str]:
    """Greedy decoding of a padded batch (the processor pads on the left): each row's new
    text, cut where it would have stopped alone (its first end token, its own token limit),
    so each equals `generate` of that request by itself."""
    import torch

    model = handle.model
    ends = model.generation_config.eos_token_id
    ends = set(ends if isinstance(ends, list) else [] if ends is None else [ends])
    try:
        inputs = inputs.to(model.device, model.dtype)
        prompt_length = inputs["input_ids"].shape[1]
        with torch.inference_mode():
            output = model.generate(**inputs, max_new_tokens=max(max_new_tokens),
                                    do_sample=False)
        rows = output[:, prompt_length:].tolist()
        del output
    finally:
        del inputs
    texts = []
    for row, limit in zip(rows, max_new_tokens, strict=True):
        row = row[:limit]
        stop = next((at for at, token in enumerate(row) if token in ends), None)
        texts.append(handle.processor.decode(row if stop is None else row[:stop + 1],
                                             skip_special_tokens=True))
    return texts
