"""Benchmarks and their peers: `layer` (one MoE layer vs transformers' block, `moerun bench`),
`model` (whole models), `offload` (expert streaming), `pagecache` (dropping the page cache),
`peers` (transformers' blocks on the same weights)."""
