"""Build a tiny, randomly initialised VibeVoice-ASR checkpoint offline, in the real hub layout.

    .venvs/hf/bin/python scripts/tiny_models/vibevoice.py --out models/tiny/vibevoice

Real config, model, processor and tokenizer classes (transformers >= 5.23), saved with
`save_pretrained`; the worker loads it through exactly the production code path. The
processor's hard-coded sizes are kept: the encoders downsample by 3200 samples per token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_bpe import build_qwen2_tokenizer  # noqa: E402

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


def build(out: Path) -> None:
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
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    build(parser.parse_args().out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
