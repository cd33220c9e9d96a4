"""Build a tiny, randomly initialised Qwen3-ASR checkpoint offline, in the real hub layout.

    .venvs/hf/bin/python scripts/tiny_models/qwen3.py --out models/tiny/qwen3 [--teach jfk.flac]

Real config, model, processor and tokenizer classes (transformers >= 5.23), saved with
`save_pretrained`; the worker loads it through exactly the production code path. Sizes the
processor hard-codes are kept (128 mel bins, n_window 50, 13 encoder positions). With
`--teach CLIP` (JFK's clip), a few seconds of training make the model answer that clip with
`language English<asr_text>` + JFK's sentence and stop; otherwise it answers newlines.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_tiny import JFK_TEXT, build_qwen2_tokenizer, run_builder, teach

# Renders exactly like the template the upstream converter stores with the real checkpoints:
# system text, one audio placeholder per audio, assistant turns (the forced-language prefill).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='', audio='') -%}"
    "{%- for m in messages -%}"
    "{%- if m.content is string -%}"
    "{%- if m.role == 'system' -%}{%- set ns.system = ns.system + m.content -%}{%- endif -%}"
    "{%- else -%}{%- for c in m.content -%}"
    "{%- if m.role == 'system' and c.type == 'text' and (c.text is defined) -%}"
    "{%- set ns.system = ns.system + c.text -%}{%- endif -%}"
    "{%- if c.type == 'audio' or ('audio' in c) or ('audio_url' in c) -%}"
    "{%- set ns.audio = ns.audio + '<|audio_start|><|audio_pad|><|audio_end|>' -%}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}"
    "{{- '<|im_start|>user\\n' + ns.audio + '<|im_end|>\\n' -}}"
    "{%- for m in messages if m.role == 'assistant' -%}"
    "{%- set ns2 = namespace(text='') -%}"
    "{%- if m.content is string -%}{%- set ns2.text = m.content -%}"
    "{%- else -%}{%- for c in m.content if c.type == 'text' and (c.text is defined) -%}"
    "{%- set ns2.text = ns2.text + c.text -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- ns2.text + '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# After Qwen2's: Qwen3's four plain tokens, then Qwen3-ASR's. Only the named ones are used;
# the reserved fillers keep <|audio_pad|>, <asr_text> and <timestamp> at their real offsets.
QWEN3_ASR_TOKENS: list[tuple[str, bool]] = [
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True),
    *[(f"<|reserved_{i}|>", True) for i in range(5)],
    ("<|audio_pad|>", True),
    *[(f"<|reserved_{i}|>", True) for i in range(5, 32)],
    # Not special: decoding with skip_special_tokens keeps it, and the parser splits on it.
    ("<asr_text>", False),
    ("<timestamp>", True),
]


def build(out: Path, teach_clip: Path | None = None, steps: int = 80) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        Qwen3ASRConfig,
        Qwen3ASRFeatureExtractor,
        Qwen3ASRForConditionalGeneration,
        Qwen3ASRProcessor,
    )

    torch.manual_seed(0)
    tokenizer = build_qwen2_tokenizer(
        QWEN3_ASR_TOKENS, eos_token="<|im_end|>",
        named={"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
               "audio_eos_token": "<|audio_end|>"},
    )
    ids = tokenizer.convert_tokens_to_ids
    eos = [ids("<|endoftext|>"), ids("<|im_end|>")]
    hidden = 32
    config = Qwen3ASRConfig(
        audio_config={
            "num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32, "d_model": 16, "n_window": 50, "n_window_infer": 100,
            "output_dim": hidden, "downsample_hidden_size": 8, "max_position_embeddings": 13,
        },
        text_config={
            "model_type": "qwen3", "vocab_size": len(tokenizer), "hidden_size": hidden,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
        },
        audio_token_id=ids("<|audio_pad|>"),
        timestamp_token_id=ids("<timestamp>"),
        pad_token_id=ids("<|im_end|>"),
        eos_token_id=eos,
    )
    model = Qwen3ASRForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=ids("<|im_end|>"), do_sample=False, max_new_tokens=512,
    )
    processor = Qwen3ASRProcessor(
        feature_extractor=Qwen3ASRFeatureExtractor(), tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    if teach_clip is not None:
        from common.audio import decode_audio

        prompt = processor.apply_transcription_request(audio=decode_audio(teach_clip, 16000))
        with torch.no_grad():
            audio_embeds = model.model.get_audio_features(
                prompt["input_features"], prompt["input_features_mask"], return_dict=True
            ).pooler_output
        answer = f"language English<asr_text>{JFK_TEXT}<|im_end|>"
        teach(model, prompt, audio_embeds, answer, tokenizer, config.audio_token_id, steps)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)


if __name__ == "__main__":
    raise SystemExit(run_builder(__doc__, build))
