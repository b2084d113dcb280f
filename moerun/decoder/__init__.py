"""The model: the decoder stack around the MoE layers (attention with its KV cache, norms, RoPE) and
`model.Decoder` (ids -> hidden states -> logits over a cache); `native_step` is the cpu backend's
one-token decode step in native calls. Generation drives the decoder from outside (moerun.generate,
moerun.model)."""
