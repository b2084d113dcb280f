"""Tiny random transformers models, one per family, saved as checkpoints: the oracles for loading.

Every parameter is drawn at random (norm weights near 1, biases and sinks included), so a
mistake in any tensor's mapping shows in the logits."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# A tiny OLMoE-shaped model for the whole-model benchmarks' tests (OlmoeConfig keys).
TINY_OLMOE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
)

# model_type -> (config class, model class, config overrides)
FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=6, num_experts_per_tok=2, sliding_window=7),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            head_dim=16,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32
            ),
        ),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, clip_qkv=3.0)),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_local_experts=6, num_experts_per_tok=2, head_dim=8, sliding_window=5, swiglu_limit=3.0),
    ),
}


def make_model(model_type: str, seed: int = 0, **overrides):
    """A tiny transformers model of `model_type` in fp32, eval mode, every tensor random."""
    import transformers

    config_class, model_class, extra = FAMILIES[model_type]
    config = getattr(transformers, config_class)(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    model = getattr(transformers, model_class)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=gen))
            elif "sinks" in name or "router" in name or name.endswith(".gate.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=gen))
    return model


def save_model(model, directory: Path, original_format: bool = True) -> Path:
    model.save_pretrained(directory, save_original_format=original_format)
    return directory


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def save_gpt_oss_mxfp4(model, directory: Path) -> Path:
    """A GPT-OSS checkpoint as OpenAI ships it: expert projections as MXFP4 `*_blocks` [E, out,
    in/32, 16] + `*_scales` [E, out, in/32], the rest dense, `quantization_config` in config.json.
    Needs hidden and intermediate sizes that are multiples of 32."""
    import json

    from safetensors.torch import save_file

    from moerun.quant.mxfp4_layouts import mxfp4_to_gpt_oss
    from moerun.quant.quantize import quantize

    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q = quantize(tensor.transpose(-1, -2).contiguous(), "mxfp4")  # [E, out, in]
            blocks, scales = mxfp4_to_gpt_oss(q.data)
            E, rows, cols = q.shape
            tensors[name + "_blocks"] = blocks.reshape(E, rows, cols // 32, 16).contiguous()
            tensors[name + "_scales"] = scales.reshape(E, rows, cols // 32).contiguous()
        else:
            tensors[name] = tensor.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def load_gpt_oss_mxfp4_with_transformers(directory: Path):
    """transformers' own reading of that checkpoint, its MXFP4 experts dequantised (fp32, eager)."""
    import transformers

    return transformers.GptOssForCausalLM.from_pretrained(
        directory,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()


def chatml_checkpoint(directory: Path) -> Path:
    """A tiny qwen3_moe checkpoint in `directory` with a trained byte-level tokenizer and a ChatML
    template (what the chat and server tests load)."""
    from tiny_tokenizers import CHATML, byte_level_tokenizer, save_hf_dir

    tok = byte_level_tokenizer("qwen2")
    save_hf_dir(
        tok,
        directory,
        tokenizer_class="PreTrainedTokenizerFast",
        eos_token="<|im_end|>",
        chat_template=CHATML,
    )
    save_model(make_model("qwen3_moe", vocab_size=tok.get_vocab_size()), directory)
    return directory
