"""The MoE layer in five stages (route, plan, experts, combine, shared expert) and its backends:
`routing` (selection specs), `plan` (assignments grouped by expert), `experts` (a layer's expert
weights), `layer` (MoELayer: the stages in order), `backends/` (torch and triton, one interface),
`activations`, `trace` (MOERUN_TRACE's per-stage figures)."""
