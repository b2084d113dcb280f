"""The MoE layer in five stages (route, plan, experts, combine, shared expert) and its backends:
`routing` (selection specs), `plan` (assignments grouped by expert), `experts` (a layer's expert
weights, and which of them this process holds), `layer` (MoELayer: the stages in order, one forward
path), `backends/` (torch, cpu and triton: objects with one interface and declared capabilities),
`run` (RunSpec: how a model runs, decided once at load), `trace` (MOERUN_TRACE's per-stage figures)."""
