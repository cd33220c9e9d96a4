"""Build a tiny, randomly initialised VibeVoice-ASR checkpoint offline, in the real hub layout.

    .venvs/hf/bin/python scripts/tiny_models/vibevoice.py --out models/tiny/vibevoice \
        [--teach jfk.flac]

Real config, model, processor and tokenizer classes (transformers >= 5.23), saved with
`save_pretrained`; the worker loads it through exactly the production code path. The
processor's hard-coded sizes are kept: the encoders downsample by 3200 samples per token.
With `--teach CLIP` (JFK's clip), a few seconds of training make the model answer that clip
with TAUGHT_ANSWER, two segments in the real JSON format, and stop; otherwise it rambles.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_tiny import build_qwen2_tokenizer, run_builder, teach

# What the model writes after its prompt (it opens the assistant turn itself).
TAUGHT_ANSWER = (
    '<|im_start|>assistant\n[{"Start":0.0,"End":7.2,"Speaker":0,"Content":"And so, my fellow '
    'Americans, ask not what your country can do for you,"},{"Start":7.2,"End":11.0,"Speaker":1,'
    '"Content":"ask what you can do for your country."}]<|im_end|>\n<|endoftext|>'
)

# Renders exactly like the template the upstream converter stores with the real checkpoint.
# It has no generation prompt: the model itself writes "<|im_start|>assistant\n" first.
CHAT_TEMPLATE = (
    "{%- set system_prompt = system_prompt | default('You are a helpful assistant that "
    "transcribes audio input into text output in JSON format.') -%}"
    "{{- '<|im_start|>system\\n' + system_prompt + '<|im_end|>' -}}"
    "{%- set audio_token = audio_token | default('<|box_start|>') -%}"
    "{%- for message in messages if message['role'] == 'user' -%}"
    "{{- '\\n<|im_start|>user\\n' -}}"
    "{%- set text_items = message['content'] | selectattr('type', 'equalto', 'text') | list -%}"
    "{%- set context_text = text_items[0]['text'] if text_items else none -%}"
    "{%- for item in message['content'] if item['type'] == 'audio' -%}"
    "{{- '<|object_ref_start|>' + audio_token + '<|object_ref_end|>\\n' -}}"
    "{%- if context_text -%}"
    "{{- 'This is a <|AUDIO_DURATION|> seconds audio, with extra info: ' + context_text + "
    "'\\n\\nPlease transcribe it with these keys: Start time, End time, Speaker ID, Content' -}}"
    "{%- else -%}"
    "{{- 'This is a <|AUDIO_DURATION|> seconds audio, please transcribe it with these keys: "
    "Start time, End time, Speaker ID, Content' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
)


def build(out: Path, teach_clip: Path | None = None, steps: int = 80) -> None:
    import torch
    from transformers import (
        VibeVoiceAcousticTokenizerFeatureExtractor,
        VibeVoiceAsrConfig,
        VibeVoiceAsrForConditionalGeneration,
        VibeVoiceAsrProcessor,
    )

    torch.manual_seed(0)
    # The real checkpoint uses Qwen2.5's tokenizer as is: <|endoftext|> ends the answer.
    tokenizer = build_qwen2_tokenizer([], eos_token="<|endoftext|>", named={})
    ids = tokenizer.convert_tokens_to_ids
    encoder = {
        "hidden_size": 8, "num_filters": 4, "kernel_size": 7, "ffn_expansion": 2,
        # Their product must stay 3200: the processor pads to it and counts one token per 3200.
        "downsampling_ratios": [4, 8, 10, 10], "depths": [1, 1, 1, 1, 1],
    }
    config = VibeVoiceAsrConfig(
        acoustic_tokenizer_encoder_config=encoder,
        semantic_tokenizer_encoder_config=encoder,
        text_config={
            "model_type": "qwen2", "vocab_size": len(tokenizer), "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
        },
        audio_token_id=ids("<|box_start|>"),
        audio_bos_token_id=ids("<|object_ref_start|>"),
        audio_eos_token_id=ids("<|object_ref_end|>"),
    )
    model = VibeVoiceAsrForConditionalGeneration(config).eval()
    generation = model.generation_config
    generation.pad_token_id = ids("<|image_pad|>")
    generation.eos_token_id = tokenizer.eos_token_id
    generation.do_sample = False
    generation.max_new_tokens = generation.max_length = 32768  # as the real one: always pass yours
    processor = VibeVoiceAsrProcessor(
        feature_extractor=VibeVoiceAcousticTokenizerFeatureExtractor(), tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    if teach_clip is not None:
        from common.audio import decode_audio

        prompt = processor.apply_transcription_request(audio=decode_audio(teach_clip, 24000))
        audio_embeds = model.model.get_audio_features(
            prompt["input_values"], prompt["padding_mask"], sample=False
        ).pooler_output
        teach(model, prompt, audio_embeds.detach(), TAUGHT_ANSWER, tokenizer,
              config.audio_token_id, steps)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)


if __name__ == "__main__":
    raise SystemExit(run_builder(__doc__, build))
