"""Expert parallelism on torch.distributed (gloo on CPU, NCCL on CUDA): each rank holds the dense
weights and a contiguous share of every MoE layer's experts; a MoE step's expert rows are computed
by the ranks owning their experts and exchanged, then every rank combines them in plan order."""

from moerun.distributed.expert_parallel import ExpertParallel, ExpertParallelError, ExpertShard

__all__ = ["ExpertParallel", "ExpertParallelError", "ExpertShard"]
