"""Routing: router logits in fp32, then one of the named selection specs.

Every spec maps router logits [T, E] (fp32) to (weights [T, k] fp32, ids [T, k] int64); a token's k
ids are distinct. Specs are frozen dataclasses: the selection rule is the type, not a set of flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RouterError(ValueError):
    """Router logits that cannot be routed (NaN or inf)."""


@dataclass(frozen=True)
class SoftmaxTopK:
    """softmax over all experts, then top-k (Mixtral renormalises; Qwen/OLMoE per `norm_topk_prob`)."""

    k: int
    renormalize: bool

    def select(self, logits: torch.Tensor, score_bias: torch.Tensor | None = None):
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


@dataclass(frozen=True)
class TopKSoftmax:
    """top-k of the logits (router bias already added), softmax over those k (GPT-OSS, GraniteMoE)."""

    k: int

    def select(self, logits: torch.Tensor, score_bias: torch.Tensor | None = None):
        top, ids = torch.topk(logits, self.k, dim=-1)
        return torch.softmax(top, dim=-1), ids


@dataclass(frozen=True)
class DeepSeekV2Softmax:
    """DeepSeek-V2: softmax scores; greedy top-k, or group-limited greedy (keep the `topk_group`
    groups with the highest max score, zero the rest, then top-k); weights times `routed_scaling`."""

    k: int
    routed_scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_limited: bool = False

    def select(self, logits: torch.Tensor, score_bias: torch.Tensor | None = None):
        scores = torch.softmax(logits, dim=-1)
        if self.group_limited:
            group_best = _grouped(scores, self.n_group).max(dim=-1).values  # [T, G]
            scores = scores.masked_fill(~_group_mask(group_best, self.topk_group, scores.shape), 0.0)
        weights, ids = torch.topk(scores, self.k, dim=-1)
        return weights * self.routed_scaling, ids


@dataclass(frozen=True)
class DeepSeekV3Sigmoid:
    """DeepSeek-V3: sigmoid scores; the choice uses scores + score-correction bias, limited to the
    `topk_group` groups with the largest sum of their top-2; the weights are the unbiased scores,
    optionally renormalised (sum + 1e-20), times `routed_scaling`."""

    k: int
    n_group: int
    topk_group: int
    renormalize: bool
    routed_scaling: float = 1.0

    def select(self, logits: torch.Tensor, score_bias: torch.Tensor | None = None):
        scores = torch.sigmoid(logits)
        for_choice = scores if score_bias is None else scores + score_bias
        group_top2 = _grouped(for_choice, self.n_group).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        keep = _group_mask(group_top2, self.topk_group, scores.shape)
        ids = torch.topk(for_choice.masked_fill(~keep, float("-inf")), self.k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling, ids


@dataclass(frozen=True)
class SparseMixer:
    """PhiMoE's sparsemixer in eval mode (top-2): each pick is the best remaining expert, weighted by
    a softmax over the experts whose logits lie within 2·jitter_eps (relative) of that pick."""

    jitter_eps: float
    k: int = 2

    def __post_init__(self):
        if self.k != 2:
            raise ValueError(f"SparseMixer routes exactly 2 experts per token, not k={self.k}.")

    def select(self, logits: torch.Tensor, score_bias: torch.Tensor | None = None):
        first_w, first = self._pick(logits, logits)
        rest = logits.scatter(-1, first, float("-inf"))
        second_w, second = self._pick(logits, rest)
        return torch.cat([first_w, second_w], dim=-1), torch.cat([first, second], dim=-1)

    def _pick(self, logits: torch.Tensor, candidates: torch.Tensor):
        best, best_id = candidates.max(dim=-1, keepdim=True)  # [T, 1]
        factor = logits.abs().clamp(min=best)
        far = ((best - logits) / factor) > 2 * self.jitter_eps
        gates = torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1)
        return gates.gather(-1, best_id), best_id


RouteSpec = SoftmaxTopK | TopKSoftmax | DeepSeekV2Softmax | DeepSeekV3Sigmoid | SparseMixer


def _grouped(scores: torch.Tensor, n_group: int) -> torch.Tensor:
    tokens, experts = scores.shape
    if experts % n_group:
        raise ValueError(f"{experts} experts cannot be split into n_group={n_group} equal groups.")
    return scores.view(tokens, n_group, experts // n_group)


def _group_mask(group_scores: torch.Tensor, topk_group: int, shape: torch.Size) -> torch.Tensor:
    """Boolean [T, E] mask of the experts inside each token's `topk_group` best groups."""
    group_ids = torch.topk(group_scores, topk_group, dim=-1).indices
    keep_group = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    return keep_group.repeat_interleave(shape[1] // group_scores.shape[1], dim=1)


def route(spec: RouteSpec, logits: torch.Tensor, score_bias: torch.Tensor | None = None):
    """logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int64), each token's slots ordered by
    expert id, so the plan's order inside a token is its slot order."""
    weights, ids = spec.select(logits, score_bias)
    ids, slot_order = torch.sort(ids, dim=-1)
    return weights.gather(-1, slot_order), ids


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, H] (any float dtype) · weight [E, H]ᵀ (+ bias [E]) in fp32 -> [T, E] fp32."""
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())


def check_logits(logits: torch.Tensor, layer_name: str) -> None:
    if not torch.isfinite(logits).all():
        nan = int(torch.isnan(logits).sum())
        inf = int(torch.isinf(logits).sum())
        bad_tokens = (~torch.isfinite(logits)).any(dim=-1).nonzero().flatten().tolist()
        raise RouterError(
            f"Router logits of layer {layer_name!r} contain {nan} NaN and {inf} inf values "
            f"(tokens {bad_tokens[:8]}{'...' if len(bad_tokens) > 8 else ''}); the hidden state or the "
            "router weights of this layer are broken."
        )


# (all logits finite: a 0-d bool tensor on the logits' device, the logits, the layer's name)
RouterCheck = tuple[torch.Tensor, torch.Tensor, str]


def deferred_check(logits: torch.Tensor, layer_name: str) -> RouterCheck:
    """What `check_logits` would test, left on the device, for `raise_on_bad_router_logits`."""
    return torch.isfinite(logits).all(), logits, layer_name


def raise_on_bad_router_logits(checks: list[RouterCheck]) -> None:
    """`check_logits` of the first layer whose deferred check failed; one host read for them all."""
    if checks and not bool(torch.stack([finite for finite, _, _ in checks]).all()):
        for _, logits, layer_name in checks:
            check_logits(logits, layer_name)
