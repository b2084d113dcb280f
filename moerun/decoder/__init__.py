"""The decoder stack around the MoE layers: attention with its KV cache, norms, RoPE, weight
placement, the linears, and `model.MoEModel` (ids -> hidden states -> logits)."""
