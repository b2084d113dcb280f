"""`moerun bench --model`: a whole generated model (OLMoE's layer shapes, a few layers, random
bf16 weights) through moerun and through transformers' own model on the very same tensors: a
prompt's logits (prefill) and single-token steps with a warm KV cache (decode), interleaved call by
call. transformers is needed for the peer and for building the weights (the `bench` extra)."""

from __future__ import annotations

import statistics

import torch

from moerun.benchmarks import BenchSettings
from moerun.benchmarks.layer import copy_bandwidth, timed
from moerun.checkpoint.hf import canonical_tensors
from moerun.families import family
from moerun.model import MoEModel
from moerun.moe.backends import resolve_backend
from moerun.moe.run import RunSpec
from moerun.quant.formats import COMPUTE_DTYPES

# OLMoE-1B-7B's shapes; the layer count is the benchmark's choice
OLMOE = dict(
    vocab_size=50304,
    hidden_size=2048,
    intermediate_size=1024,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
    max_position_embeddings=4096,
)


# DeepSeek-V2-Lite's shapes (MLA attention without q_lora, 64 routed experts top-6, 2 shared, the
# first layer dense); the layer count is the benchmark's choice
DEEPSEEK_V2_LITE = dict(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    topk_method="greedy",
    routed_scaling_factor=1.0,
    max_position_embeddings=4096,
)
GENERATED = {  # --generated NAME -> (model_type, transformers config and model classes, shapes)
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeForCausalLM", OLMOE),
    "deepseek-v2-lite": ("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", DEEPSEEK_V2_LITE),
}


def build_pair(
    layers: int,
    dtype: torch.dtype,
    shape: dict | None = None,
    device: str = "cpu",
    backend: str = "torch",
    generated: str = "olmoe",
):
    """(transformers model, MoEModel) sharing every weight tensor, on `device`: `generated` names
    the shapes (GENERATED); `shape` overrides their config values (tests use tiny ones)."""
    import transformers

    model_type, config_class, model_class, shapes = GENERATED[generated]
    config = getattr(transformers, config_class)(**{**shapes, **(shape or {}), "num_hidden_layers": layers})
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        peer = getattr(transformers, model_class)(config)
    peer = peer.to_empty(device="cpu").to(dtype).eval()
    # to_empty leaves buffers uninitialised: rebuild the rotary embedding's inverse frequencies
    peer.model.rotary_emb = type(peer.model.rotary_emb)(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in [*peer.named_parameters(), *peer.named_buffers()]:
            if "inv_freq" in name:
                continue
            if "norm" in name:
                p.fill_(1.0)
            elif "e_score_correction_bias" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(dtype))
    peer = peer.to(device)
    model_config = family(model_type).model_config(config.to_dict())
    state = peer.state_dict()
    tensors, _ = canonical_tensors(model_type, model_config, state.keys(), state.__getitem__)
    return peer, MoEModel(model_config, tensors, RunSpec.make(device, dtype, backend))


def logged_pair(layers: int, settings: BenchSettings, shape: dict | None, generated: str = "olmoe"):
    """build_pair for a benchmark: the device (default cuda when there is one) and backend resolved,
    what is built said through the settings' `log` -> (transformers model, MoEModel, device, backend)."""
    dtype = settings.dtype
    device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend(settings.backend, torch.device(device))
    settings.log(
        f"building a random {layers}-layer {generated}-shaped model in {dtype} on {device} "
        f"({backend} backend; moerun and transformers share it)"
    )
    peer, ours = build_pair(layers, COMPUTE_DTYPES[dtype], shape, device, backend, generated)
    return peer, ours, device, backend


def generated_run(
    layers: int,
    dtype: str,
    device: str,
    backend: str,
    prompt_tokens: int,
    new_tokens: int,
    generated: str = "olmoe",
) -> dict:
    """What a benchmark on a generated model ran on, the head of its result."""
    return {
        "model": f"{generated}-shaped, {layers} layers",
        "dtype": dtype,
        "device": device,
        "backend": backend,
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
    }


def run_model_bench(
    settings: BenchSettings,
    layers: int = 4,
    prompt_tokens: int = 512,
    shape: dict | None = None,
    generated: str = "olmoe",
) -> dict:
    from transformers import DynamicCache

    dtype, decode_steps, repeats, log = settings.dtype, settings.decode_steps, settings.repeats, settings.log
    torch_dtype = COMPUTE_DTYPES[dtype]
    peer, ours, device, backend = logged_pair(layers, settings, shape, generated)
    vocab = peer.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, prompt_tokens), generator=gen).to(device)
    steps = torch.randint(0, vocab, (decode_steps + 1,), generator=gen).tolist()

    def peer_logits():
        return peer(ids).logits.float()

    prefill = {"moerun": [], "transformers": []}
    decode = {"moerun": [], "transformers": []}
    with torch.inference_mode():
        log("measuring copy bandwidth")
        copy = copy_bandwidth(device)
        log(f"prefill: logits of a {prompt_tokens}-token prompt x{repeats}, interleaved")
        ours.logits(ids[:, :16]), peer(ids[:, :16])  # warm-up
        for _ in range(repeats):
            prefill["moerun"].append(timed(lambda: ours.logits(ids), device))
            prefill["transformers"].append(timed(peer_logits, device))
        ours_logits, peer_logits_out = ours.logits(ids), peer_logits()
        log(f"decode: {decode_steps} single-token steps after a {prompt_tokens}-token prompt, interleaved")
        cache = ours.new_cache(1, prompt_tokens + len(steps))
        ours.forward(ids, cache)
        peer_cache = DynamicCache(config=peer.config)
        peer(ids, cache=peer_cache, use_cache=True)
        for i, token in enumerate(steps):
            tok = torch.tensor([[token]], device=device)
            t_ours = timed(lambda tok=tok: ours.hidden_logits(ours.forward(tok, cache)), device)
            t_peer = timed(lambda tok=tok: peer(tok, cache=peer_cache, use_cache=True).logits, device)
            if i:  # the first step pays one-time costs on both sides
                decode["moerun"].append(t_ours)
                decode["transformers"].append(t_peer)
        log("generate: 32-token prompt, 16 new tokens (greedy), each side's own generate, interleaved")
        generate_s = _generate_seconds(ours, peer, ids[:, :32], repeats, device)
    prefill_s = {k: statistics.median(v) for k, v in prefill.items()}
    decode_s = {k: statistics.median(v) for k, v in decode.items()}
    bytes_per_step = _decode_bytes_per_step(ours, torch_dtype)
    diff = (ours_logits - peer_logits_out).abs().max() / peer_logits_out.abs().max()
    return {
        "model": f"{generated}-shaped, {layers} layers",
        "dtype": dtype,
        "device": device,
        "backend": backend,
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "copy_bytes_per_s": copy,
        "prefill_tok_s": prompt_tokens / prefill_s["moerun"],
        "peer_prefill_tok_s": prompt_tokens / prefill_s["transformers"],
        "prefill_vs_peer": prefill_s["transformers"] / prefill_s["moerun"],
        "decode_tok_s": 1 / decode_s["moerun"],
        "peer_decode_tok_s": 1 / decode_s["transformers"],
        "decode_vs_peer": decode_s["transformers"] / decode_s["moerun"],
        "generate_tok_s": 16 / generate_s["moerun"],
        "peer_generate_tok_s": 16 / generate_s["transformers"],
        "generate_vs_peer": generate_s["transformers"] / generate_s["moerun"],
        "decode_bytes_per_step": bytes_per_step,
        "decode_bytes_per_s": bytes_per_step / decode_s["moerun"],
        "decode_roofline_fraction": bytes_per_step / decode_s["moerun"] / copy,
        "peer_max_rel_diff": diff.item(),
        "same_greedy_last_token": bool(ours_logits[0, -1].argmax() == peer_logits_out[0, -1].argmax()),
        "kv_bytes_per_token": cache.bytes_per_position,
        "peer_kv_bytes_per_token": _kv_bytes_per_token(peer_cache),
    }


_GREEDY_16 = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False, "pad_token_id": 0}


def _generate_seconds(ours: MoEModel, peer, prompt: torch.Tensor, repeats: int, device: str) -> dict:
    """Median seconds of each side's own generate: `prompt` [1, P], 16 new tokens (greedy)."""
    ids = prompt[0].tolist()
    seconds = {"moerun": [], "transformers": []}
    for _ in range(repeats):
        seconds["moerun"].append(timed(lambda: list(ours.generate(ids, max_new_tokens=16)), device))
        seconds["transformers"].append(timed(lambda: peer.generate(prompt, **_GREEDY_16)))
    return {k: statistics.median(v) for k, v in seconds.items()}


def _decode_bytes_per_step(ours: MoEModel, dtype: torch.dtype) -> int:
    """Weight bytes one decode step reads: top-k experts and the shared expert of each MoE layer, the
    dense MLPs, the attention weights and the lm_head."""
    spec, config = ours.config.moe, ours.config
    expert_bytes = 3 * spec.hidden * spec.intermediate * dtype.itemsize
    shared_bytes = 3 * spec.hidden * spec.shared_intermediate * dtype.itemsize
    dense_bytes = 3 * spec.hidden * config.dense_intermediate * dtype.itemsize
    moe_layers = sum(config.moe_layers)
    return (
        moe_layers * (spec.top_k * expert_bytes + shared_bytes)
        + (config.num_layers - moe_layers) * dense_bytes
        + sum(t.numel() * t.element_size() for a in ours.attentions for t in a.t.values())
        + ours.lm_head.numel() * ours.lm_head.element_size()
    )


def _kv_bytes_per_token(peer_cache) -> int:
    """Bytes a transformers cache holds per position."""
    return sum(
        t.numel() * t.element_size()
        for layer in getattr(peer_cache, "layers", [])
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    ) // max(peer_cache.get_seq_length(), 1)


def format_model_table(r: dict) -> str:
    gb = 1e9
    return "\n".join(
        [
            f"moerun bench --model  {r['model']}  dtype={r['dtype']}  device={r['device']}  "
            f"backend={r['backend']}  threads={r['threads']}",
            f"  copy bandwidth (read+write)   {r['copy_bytes_per_s'] / gb:8.1f} GB/s",
            f"  prefill T={r['prompt_tokens']:<5}  moerun {r['prefill_tok_s']:8.1f} tok/s   "
            f"transformers {r['peer_prefill_tok_s']:8.1f} tok/s   ({r['prefill_vs_peer']:.2f}x)",
            f"  decode        moerun {r['decode_tok_s']:8.1f} tok/s   "
            f"transformers {r['peer_decode_tok_s']:8.1f} tok/s   ({r['decode_vs_peer']:.2f}x)",
            f"  generate 32+16  moerun {r['generate_tok_s']:8.1f} tok/s   "
            f"transformers {r['peer_generate_tok_s']:8.1f} tok/s   ({r['generate_vs_peer']:.2f}x)",
            f"  KV cache per token  moerun {r['kv_bytes_per_token']} B   "
            f"transformers {r['peer_kv_bytes_per_token']} B",
            f"  decode reads {r['decode_bytes_per_step'] / 2**20:.0f} MiB per token: "
            f"{r['decode_bytes_per_s'] / gb:.1f} GB/s "
            f"({100 * r['decode_roofline_fraction']:.0f}% of copy bandwidth)",
            f"  max |moerun - transformers| / max |transformers| logits {r['peer_max_rel_diff']:.1e}; "
            f"same next token: {r['same_greedy_last_token']}",
        ]
    )
