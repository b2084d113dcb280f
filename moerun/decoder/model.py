"""The decoder stack around the MoE layers: embed -> [attention, MoE or dense MLP] x layers -> norm
-> lm_head, run over a preallocated KV cache in chunks of positions.

`Decoder` computes logits from ids and a cache, nothing else: generation, batching and serving drive
it (moerun.generate, moerun.batching, moerun.serve), and `moerun.model.MoEModel` is a Decoder with
generation. It holds canonical tensors (`ModelConfig.tensor_shapes`), which loaders build from files,
and runs as its `RunSpec` says (moerun.moe.run): one forward path (`_run`), which the cpu backend's
one-call decode step (moerun.decoder.native_step) replaces for one token of one sequence.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from moerun import cpu
from moerun.decoder.attention import Attention
from moerun.decoder.config import MLASpec, ModelConfig
from moerun.decoder.kv_cache import KVCache
from moerun.decoder.mla import MLAttention
from moerun.decoder.native_step import NativeDecodeStep
from moerun.decoder.norm import normed
from moerun.decoder.rope import Rotary
from moerun.linear import Linear
from moerun.moe.layer import MoELayer, StateDictError, tensor_problems
from moerun.moe.routing import RouterCheck, raise_on_bad_router_logits
from moerun.moe.run import RunSpec
from moerun.offload import NextLayerPrefetch
from moerun.placement import place
from moerun.quant.dequant import dequantize, dequantize_bytes
from moerun.quant.formats import QTensor, storage_free
from moerun.text.tokenizer import Tokenizer


def _resident_mb() -> float | None:
    """This process's resident memory (VmRSS) in MiB; None where /proc is not there (not Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class ContextError(ValueError):
    """A sequence longer than the model's context."""


class DenseMLP:
    def __init__(self, gate_up, down, activation, project: Linear):
        self.gate_up, self.down, self.activation, self.project = gate_up, down, activation, project

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.project(x, self.gate_up).float()).to(x.dtype)  # [B, T, I]
        return self.project(h, self.down)


def placed_dense(t: torch.Tensor | QTensor, run: RunSpec) -> torch.Tensor | QTensor:
    """A dense-part weight where and as the model computes with it: a linear's quantised weight
    kept as stored where the backend's linears read the file's format, anything else dense in the
    compute dtype; streamed, off the file's map (only the expert store reads the file); on a rank
    that serves only its experts, a storage-free stand-in (shapes only, nothing read or copied)."""
    if run.serves_experts_only:
        return (
            storage_free(t)
            if isinstance(t, QTensor)
            else torch.empty(t.shape, dtype=run.dtype, device="meta")
        )
    own = run.expert_cache is not None
    if isinstance(t, QTensor) and run.backend.native_linears and len(t.shape) == 2:
        if not own and run.device.type == "cpu":  # read where the file put it: the native
            return t  # kernels' sums of quantised blocks do not depend on an address
        return QTensor(t.format, t.shape, place(t.data, run.device, own=own))
    t = dequantize(t) if isinstance(t, QTensor) else t
    return place(t, run.device, run.dtype, own=own)


class Decoder:
    def __init__(
        self,
        config: ModelConfig,
        tensors: Mapping[str, torch.Tensor | QTensor],
        run: RunSpec,
        tokenizer: Tokenizer | None = None,
        progress: Callable[[int, int], None] | None = None,
    ):
        """`run`: how it runs (moerun.moe.run.RunSpec: device, dtype, backend, streaming, expert
        parallelism). `tokenizer`: for text prompts and outputs (None: ids only). `progress(done,
        total)` is called as layers are placed (for a loading bar). Expert parallelism: this rank
        holds only its share of each MoE layer's experts (cut here from whatever arrives whole)."""
        ep = run.expert_parallel
        held = None
        if ep is not None:  # this rank's share of every MoE layer's experts (views)
            shard = ep.shard(config.moe.num_experts)
            tensors, held = shard.cut(tensors), shard.size
        check_model_tensors(config, tensors, held=held)
        self.config, self.run, self.tokenizer = config, run, tokenizer
        self.dtype, self.device, self.prefill_chunk = run.dtype, run.device, run.prefill_chunk
        self.expert_cache, self.expert_parallel = run.expert_cache, ep
        self.prefetch = (
            NextLayerPrefetch(run.expert_cache, run.prefetch_k) if run.expert_cache is not None else None
        )
        self.project: Linear = run.backend.linear
        self._build(tensors, progress)
        moe_layers = [i for i, moe in enumerate(config.moe_layers) if moe]
        self._next_moe = {a: b for a, b in zip(moe_layers, moe_layers[1:], strict=False)}
        self._moes = [self.mlps[i] for i in moe_layers]
        # prefill's activations in fp32 where the native kernels compute the quantised projections
        # (dense bf16 weights with many rows go through torch's bf16 GEMM, which wants bf16 inputs)
        self._fp32_activations = run.backend.native_linears and any(
            isinstance(w, QTensor) for a in self.attentions for w in a.t.values()
        )
        # one token of one sequence in native calls, where the backend has them and the stack is one
        # those calls compute (moerun.decoder.native_step)
        self._decode_step = NativeDecodeStep(self) if NativeDecodeStep.supports(self) else None
        if ep is not None:
            moe = config.moe
            ep.bind(len(moe_layers), moe.hidden, moe.top_k, moe.num_experts, self.device)

    def _build(self, tensors: Mapping[str, torch.Tensor | QTensor], progress) -> None:
        """Place the dense part and build every layer from the canonical tensors."""
        config, run = self.config, self.run

        def dense(name: str, present: bool = True) -> torch.Tensor | QTensor | None:
            return placed_dense(tensors[name], run) if present else None

        layer_norm = config.norm == "layer"  # the norms' biases (LayerNorm); None: RMSNorm
        self.embed = dense("embed.weight")  # [V, H]
        self.lm_head = self.embed if config.tie_embeddings else dense("lm_head.weight")
        self.lm_head_bias = dense("lm_head.bias", config.lm_head_bias)
        self.norm, self.norm_bias = dense("norm.weight"), dense("norm.bias", layer_norm)
        self.rotary = Rotary(config.attention.rope, config.attention.head_dim, self.device)
        self.attn_norms, self.mlp_norms, self.attentions, self.mlps = [], [], [], []
        self.attn_norm_biases, self.mlp_norm_biases = [], []
        kind = MLAttention if isinstance(config.attention, MLASpec) else Attention
        for i in range(config.num_layers):
            if progress:
                progress(i, config.num_layers)
            p = f"layers.{i}."
            self.attn_norms.append(dense(p + "attn_norm.weight"))
            self.mlp_norms.append(dense(p + "mlp_norm.weight"))
            self.attn_norm_biases.append(dense(p + "attn_norm.bias", layer_norm))
            self.mlp_norm_biases.append(dense(p + "mlp_norm.bias", layer_norm))
            attn = {k: dense(p + "attn." + k) for k in config.attention.tensor_shapes()}
            window = config.sliding_windows[i]
            self.attentions.append(kind(config.attention, attn, self.rotary, window, self.project))
            if config.moe_layers[i]:
                moe = {k: tensors[p + "moe." + k] for k in config.moe.tensor_shapes()}
                self.mlps.append(MoELayer.from_tensors(config.moe, moe, name=p + "moe", run=run))
            else:
                gate_up, down = dense(p + "mlp.gate_up"), dense(p + "mlp.down")
                self.mlps.append(DenseMLP(gate_up, down, config.dense_activation, self.project))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        if max_len > self.config.max_positions:
            raise ContextError(
                f"A sequence of {max_len} positions is longer than this model's context of "
                f"{self.config.max_positions} (max_position_embeddings)."
            )
        n = self.config.num_layers
        cache = KVCache.allocate(n, batch, self.config.attention, max_len, self.dtype, self.device)
        if self.rotary.boundary is not None:  # LongRoPE: the ids, to compute them again (_longrope)
            cache.tokens = torch.zeros((batch, max_len), dtype=torch.long, device=self.device)
        return cache

    def forward(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids [B, T] at the cache's next positions -> final hidden states [B, T, H]; advances the cache."""
        start, T = cache.length, ids.shape[1]
        if start + T > cache.capacity:
            raise ContextError(f"{start + T} positions do not fit a KV cache of {cache.capacity}.")
        reach = max(start + T, cache.rope_reach)  # LongRoPE's set: see _longrope
        self._longrope(cache, ids, reach)
        if self._decode_step is not None and ids.shape == (1, 1):
            return self._decode_step(ids, cache)
        positions = torch.arange(start, start + T, device=self.device)

        def attend(i: int, attn: Attention, h: torch.Tensor, cos_sin) -> torch.Tensor:
            return attn(h, cos_sin, cache.keys[i], cache.values[i], start)

        x = self._run(ids, positions, attend, reach)
        cache.length = start + T
        return x

    def forward_sequences(self, chunks: Sequence[torch.Tensor], caches: Sequence[KVCache]) -> torch.Tensor:
        """Several sequences' next tokens in one pass: chunks[i] (1-D ids) at caches[i]'s next
        positions -> the final hidden state at each chunk's last position [S, H]; advances each
        cache. Embedding, norms, projections and the MoE layers see all the tokens as one batch (an
        expert that several sequences chose is read once); attention runs per sequence over its own
        cache. One sequence is `forward`, the same computation as running it alone."""
        if len(chunks) == 1:
            return self.forward(chunks[0].view(1, -1), caches[0])[0, -1:]
        lengths = [len(c) for c in chunks]
        for cache, T in zip(caches, lengths, strict=True):
            if cache.length + T > cache.capacity:
                raise ContextError(f"{cache.length + T} positions do not fit a KV cache of {cache.capacity}.")
        for cache, chunk in zip(caches, chunks, strict=True):
            self._longrope(cache, chunk.view(1, -1), max(cache.length + len(chunk), cache.rope_reach))
        spans = [(c.length, c.length + T) for c, T in zip(caches, lengths, strict=True)]
        positions = torch.cat([torch.arange(a, b, device=self.device) for a, b in spans])
        reach = torch.cat(  # LongRoPE's set, each sequence's own
            [
                torch.full((b - a,), max(b, c.rope_reach), device=self.device)
                for (a, b), c in zip(spans, caches, strict=True)
            ]
        )

        def attend(i: int, attn: Attention, h: torch.Tensor, cos_sin) -> torch.Tensor:
            segments = [(c.keys[i], c.values[i], c.length, T) for c, T in zip(caches, lengths, strict=True)]
            return attn.ragged(h, cos_sin, segments)

        x = self._run(torch.cat(list(chunks)).view(1, -1), positions, attend, reach)
        for cache, T in zip(caches, lengths, strict=True):
            cache.length += T
        ends = torch.tensor(lengths).cumsum(0) - 1
        return x[0, ends.to(x.device)]

    def _longrope(self, cache: KVCache, ids: torch.Tensor, reach: int) -> None:
        """LongRoPE, before a pass of `ids` [B, T] over `cache` that reaches `reach` positions: where
        the pass uses the other set than the one that rotated the cached positions (the sequence
        crosses original_max_position_embeddings; or a prefix reused from one past it), those
        positions are computed again with it first, as transformers' generate does for PhiMoE and
        Phi-3 (it drops the cache when a sequence first grows past the boundary); then the ids are
        kept. Other RoPE kinds: nothing."""
        if cache.tokens is None:
            return
        start, long = cache.length, reach > self.rotary.boundary
        if start and long != cache.rope_long:
            cache.length = 0
            for s in range(0, start, self.prefill_chunk):
                chunk = cache.tokens[:, s : min(start, s + self.prefill_chunk)]

                def attend(i: int, attn: Attention, h: torch.Tensor, cos_sin, s: int = s) -> torch.Tensor:
                    return attn(h, cos_sin, cache.keys[i], cache.values[i], s)

                self._run(chunk, torch.arange(s, s + chunk.shape[1], device=self.device), attend, reach)
                cache.length = s + chunk.shape[1]
        cache.rope_long = long
        cache.tokens[:, start : start + ids.shape[-1]] = ids

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, attend, reach=None) -> torch.Tensor:
        """ids [B, T] at `positions` [T] -> final hidden states [B, T, H]; `attend(i, attention, h,
        cos_sin)` runs layer i's attention on normed hidden states h against the right cache;
        `reach` [T]: the length each position's sequence reaches in this pass (Rotary.cos_sin)."""
        # quantised linears on the native kernels compute in fp32: the activations stay fp32 between
        # them (as in a decode step), no round trips through the compute dtype; the KV cache keeps it
        act_dtype = torch.float32 if self._fp32_activations else self.dtype
        cos_sin = self.rotary.cos_sin(positions, act_dtype, reach)
        x = self._embed(ids.to(self.device)).to(act_dtype)  # [B, T, H]
        if self.expert_cache is not None:
            self.expert_cache.begin_step()
        # each MoE layer's router-logit check, read back once for the whole pass rather than once a
        # layer (a host sync per layer would stall a GPU between layers)
        checks: list[RouterCheck] = []
        with self._parallel_step(ids.numel(), act_dtype, self._prefetches()):
            for i, (attn, mlp) in enumerate(zip(self.attentions, self.mlps, strict=True)):
                x = x + self._residual(attend(i, attn, self._attn_norm(i, x), cos_sin))
                h = self._mlp_norm(i, x)
                if not self.config.moe_layers[i]:
                    x = x + self._residual(mlp(h))
                    continue
                x = x + self._residual(mlp(h, after_fetch=self._after_fetch(i, x), router_checks=checks))
        raise_on_bad_router_logits(checks)
        if self.expert_cache is not None:
            self.expert_cache.end_step()
        return normed(x, self.norm, self.norm_bias, self.config.norm_eps).to(self.dtype)

    def _parallel_step(self, tokens: int, dtype: torch.dtype, predicts: bool):
        """Expert parallelism on rank 0: the other ranks serve the MoE layers of the pass this block
        runs, of `tokens` tokens with activations in `dtype`, `predicts`: each layer's inputs carry
        the next one's expert mass, for them to prefetch (ExpertParallel.step); else nothing."""
        ep = self.expert_parallel
        return ep.step(tokens, dtype, predicts) if ep is not None else contextlib.nullcontext()

    def _prefetches(self) -> bool:
        """Whether this step prefetches each next MoE layer's predicted experts."""
        return self.prefetch is not None and self.prefetch.active

    def _attn_norm(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return normed(x, self.attn_norms[i], self.attn_norm_biases[i], self.config.norm_eps)

    def _mlp_norm(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return normed(x, self.mlp_norms[i], self.mlp_norm_biases[i], self.config.norm_eps)

    def _residual(self, out: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream (GraniteMoE: times residual_multiplier)."""
        r = self.config.residual_multiplier
        return out if r == 1.0 else out * r

    def _after_fetch(self, i: int, x: torch.Tensor) -> Callable[[], None] | None:
        """What MoE layer i runs once its experts are fetched: with prefetch on, start loading the
        next MoE layer's predicted experts for the residual stream x (its router on its norm of x);
        else None. Expert parallelism: the prediction is made now, for the other ranks too (it
        goes with layer i's inputs)."""
        following = self._next_moe.get(i)
        if following is None or not self._prefetches():
            return None
        moe = self.mlps[following]

        def mass() -> torch.Tensor:  # [E]
            return moe.expert_mass(self._mlp_norm(following, x))

        if self.expert_parallel is None:
            return lambda: self.prefetch.start(moe.name, mass())
        predicted = mass()
        self.expert_parallel.predict(predicted)
        return functools.partial(self.prefetch.start, moe.name, predicted, moe.experts.owned)

    def hidden_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., H] -> logits fp32 [..., vocab] (the native kernels compute them in
        fp32 and return them so, not rounded to the compute dtype)."""
        hidden = hidden.float() if self.run.backend.native_linears else hidden
        logits = self.project(hidden, self.lm_head, self.lm_head_bias).float()
        scaling = self.config.logits_scaling  # GraniteMoE's
        return logits if scaling == 1.0 else logits / scaling

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> their embedding rows [B, T, H] in the compute dtype (a quantised table's
        rows are dequantised as they are looked up), times the embedding multiplier (GraniteMoE)."""
        if isinstance(self.embed, QTensor) and self.run.backend.native_linears:
            rows = cpu.dequantize_rows(self.embed.format.name, self.embed.data, self.embed.shape[1], ids)
            rows = rows.to(self.dtype).view(*ids.shape, -1)
        elif isinstance(self.embed, QTensor):
            data = self.embed.data[ids.reshape(-1)]  # [B*T, row_bytes]: only the rows looked up
            rows = dequantize_bytes(self.embed.format, data, self.dtype).view(*ids.shape, -1)
        else:
            rows = F.embedding(ids, self.embed)
        m = self.config.embedding_multiplier
        return rows if m == 1.0 else rows * m

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids LongTensor [B, T] (or [T], or lists of ints) -> logits fp32 [B, T, vocab], with a
        fresh cache; prefill in chunks."""
        if isinstance(ids, str) or (isinstance(ids, Sequence) and any(isinstance(i, str) for i in ids)):
            raise TypeError("logits takes token ids, not text: encode it first with model.tokenizer.encode.")
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError("logits takes token ids: a LongTensor [B, T] or [T], or lists of ints.") from None
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.dim() not in (1, 2):
            raise TypeError(
                f"logits takes integer token ids of shape [B, T] or [T], "
                f"not {ids.dtype} of shape {list(ids.shape)}."
            )
        if ids.dim() == 1:
            ids = ids[None]
        self.check_ids(ids)
        cache = self.new_cache(ids.shape[0], ids.shape[1])
        cache.rope_reach = ids.shape[1]  # LongRoPE: every chunk as one pass over them all would
        chunks = [
            self.hidden_logits(self.forward(ids[:, s : s + self.prefill_chunk], cache))
            for s in range(0, ids.shape[1], self.prefill_chunk)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A two-token prompt and one decode step on a throwaway cache, so that whatever compiles
        or loads on first use (the native kernels' build, Triton autotuning) does so now, not inside a timed
        generation or between streamed tokens (llama.cpp's warm-up run)."""
        cache = self.new_cache(1, 3)
        ids = torch.zeros((1, 2), dtype=torch.long)
        self.hidden_logits(self.forward(ids, cache)[0, -1])
        self.hidden_logits(self.forward(ids[:, :1], cache)[0, -1])

    def parallel_stats(self) -> dict | None:
        """Expert parallelism: this rank's placement and, summed over its steps and for the last
        one, the bytes it sent in exchanges, their milliseconds and its own experts' milliseconds,
        and its resident memory (MiB; None off Linux). None without expert parallelism."""
        ep = self.expert_parallel
        if ep is None:
            return None
        return {
            "rank": ep.rank,
            "world": ep.world,
            "placement": ep.placement(self.config.moe.num_experts),
            "collective": ep.collective,
            "rss_mb": _resident_mb(),
            **ep.stats.as_dict(),
        }

    def serve_experts(self) -> None:
        """Expert parallelism, every rank but 0: compute this rank's experts for each forward pass
        rank 0 runs (whatever drives it there: generate, a server, a benchmark), until rank 0 closes
        its model or exits. Raises ExpertParallelError when rank 0 or another rank stops answering."""
        ep = self.expert_parallel
        if ep is None or ep.leads:
            raise ValueError("serve_experts runs on the ranks other than 0 of an expert-parallel model.")
        layers = [i for i, moe in enumerate(self.config.moe_layers) if moe]
        with torch.inference_mode():
            while (step := ep.next_step()) is not None:
                tokens, dtype, predicts = step
                if self.expert_cache is not None:
                    self.expert_cache.begin_step()
                for i in layers:
                    following = self._next_moe.get(i)  # rank 0's prediction of it comes with i's inputs
                    predicted = predicts and following is not None
                    prefetch = None
                    if predicted and self._prefetches():  # this rank prefetches its own from it
                        moe = self.mlps[following]
                        prefetch = functools.partial(self.prefetch.start, moe.name, owned=moe.experts.owned)
                    if not self.mlps[i].serve_step(tokens, dtype, predicted, prefetch):
                        break  # rank 0 called off the rest of the step (an error there)
                if self.expert_cache is not None:
                    self.expert_cache.end_step()
        ep.finish()  # rank 0 is done with the group: this rank's heartbeat stops too

    def close(self) -> None:
        """Stop expert streaming's reader threads (waiting for reads in flight) and close its files;
        with expert parallelism, on rank 0, release the other ranks (their serve_experts returns)."""
        if self.expert_cache is not None:
            self.expert_cache.close()
        if self.expert_parallel is not None:
            self.expert_parallel.finish()

    def check_ids(self, ids: torch.Tensor) -> None:
        length, V = ids.shape[-1], self.config.vocab_size
        if length > self.config.max_positions:
            raise ContextError(
                f"A sequence of {length} tokens is longer than this model's context of "
                f"{self.config.max_positions} (max_position_embeddings)."
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"Token ids must lie in [0, {V}) for this model's vocabulary of {V}.")


def check_model_tensors(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor | QTensor],
    sources: Mapping[str, str] | None = None,
    where: str = "",
    held: int | None = None,
) -> None:
    """One StateDictError listing every missing, unexpected and mis-shaped tensor of the model;
    `sources` (canonical name -> checkpoint name) and `where` (the file) make the message concrete;
    `held`: the experts of each MoE layer the tensors hold (expert parallelism: a rank's share)."""
    problems = tensor_problems(config.tensor_shapes(held), tensors, sources, limit=2)  # one short sentence
    if problems:
        raise StateDictError(
            f"{f'{where}: the' if where else 'The'} {config.model_type} checkpoint's tensors do not fit "
            "its config: " + " | ".join(problems) + "."
        )
