"""`moerun.load`: a checkpoint directory, file or locally cached hub id -> a runnable `MoEModel`.

Files are opened only through `moerun.loader`; family files map configs and names.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from moerun.checkpoint.fit import choose_fit
from moerun.checkpoint.hf import canonical_tensors
from moerun.decoder.config import ModelConfig
from moerun.decoder.model import check_model_tensors
from moerun.distributed import ExpertParallel
from moerun.errors import CheckpointError, ConfigError, TensorError, in_file, quote, shorten
from moerun.families import family
from moerun.families.fields import CheckedConfig
from moerun.loader import GGUFFile, SafetensorsCheckpoint, resolve_checkpoint
from moerun.loader.hf_config import read_hf_config
from moerun.loader.mapped import MappedFile, populate_in_background
from moerun.model import MoEModel
from moerun.moe.backends import ActivationMode, make_backend
from moerun.moe.layer import FP32_TENSORS
from moerun.moe.run import RunSpec
from moerun.offload import CacheBudgetError, ExpertCache, ExpertStore
from moerun.offload.pieces import stand_ins
from moerun.quant.cache import DequantCache
from moerun.quant.formats import QTensor
from moerun.quant.halves import GateUpHalves, file_views
from moerun.quant.scales import first_nonfinite_block
from moerun.text.tokenizer import Tokenizer

# streamed expert projections: left as the file has them (the expert store converts on read)
_STREAMED = re.compile(r"\.moe\.experts\.(gate_up|down)$")


def hf_paths(root: Path) -> tuple[Path, Path]:
    """A Hugging Face checkpoint directory, or a file in one (its config.json, a .safetensors file or
    index) -> (the directory, what `SafetensorsCheckpoint` opens). Any other file is refused: it is
    neither a checkpoint directory nor (wanting the .gguf name) a GGUF file."""
    if root.is_dir():
        return root, root
    if root.name == "config.json":
        return root.parent, root.parent
    if root.name.endswith((".safetensors", ".safetensors.index.json")):
        return root.parent, root
    raise CheckpointError(
        f"{root}: neither a checkpoint directory nor a GGUF file; give a Hugging Face checkpoint "
        "directory (config.json and .safetensors files) or a file whose name ends in .gguf."
    )


def hf_model_config(directory: Path) -> ModelConfig:
    """The model config.json describes, every field checked (moerun.families.fields)."""
    config = read_hf_config(directory)
    model_type = config["model_type"]
    path = directory / "config.json"
    try:
        fam = family(model_type)
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not hasattr(fam, "model_config"):
        raise ConfigError(f"{path}: loading whole {model_type} models is not supported yet.")
    try:
        return fam.model_config(CheckedConfig(config))
    except ConfigError as err:
        raise in_file(err, path) from None


def _hf_model(
    root: Path,
    checkpoint: SafetensorsCheckpoint,
    model_config: ModelConfig,
    dtype: torch.dtype,
    streamed: bool,
    share=None,
    experts_only: bool = False,
    experts_in_place: bool = False,
) -> tuple[dict, list[MappedFile]]:
    """The checkpoint's canonical tensors, checked, in their compute dtypes; `share` (expert
    parallelism, resident experts): only this rank's experts, cut before anything is copied;
    `experts_only` (every rank but 0): every other tensor a storage-free stand-in, nothing read;
    `experts_in_place`: per-expert projections already in `dtype` stay views of the file."""

    def release(name: str) -> None:
        if name in checkpoint:
            checkpoint.release(name)

    try:
        tensors, sources = canonical_tensors(
            model_config.model_type,
            model_config,
            checkpoint.names(),
            checkpoint.tensor,
            release,
            assemble=not streamed,
            share=share,
            experts_only=experts_only,
            in_place_dtype=dtype if experts_in_place else None,
        )
    except CheckpointError as err:
        raise in_file(err, root) from None
    held = share.size if share is not None else None
    check_model_tensors(model_config, stand_ins(tensors), sources, where=str(root), held=held)
    files = [MappedFile(f.path, f.mapped) for f in checkpoint.shards]
    return converted(tensors, sources, dtype, release, streamed, experts_only), files


def converted(
    tensors: dict,
    sources: dict[str, str],
    dtype: torch.dtype,
    release: Callable[[str], None],
    streamed: bool = False,
    experts_only: bool = False,
) -> dict:
    """Dense floating tensors in their compute dtype (router tensors in fp32), converted one at a
    time and each source's mapped pages released after, so a file in another dtype is never held
    in memory next to the whole converted model. Same-dtype tensors stay views of the file; so do
    the expert projections when `streamed`, and everything but them when `experts_only` (expert
    parallelism, a rank other than 0: it never computes the dense part)."""
    out = {}
    for name, tensor in tensors.items():
        _, moe, within = name.partition(".moe.")
        target = torch.float32 if moe and within in FP32_TENSORS else dtype
        if (streamed and _STREAMED.search(name)) or (experts_only and not within.startswith("experts.")):
            out[name] = tensor
            continue
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != target:
            tensor = tensor.to(target)
            for source in sources.get(name, "").split(" + "):
                release(source)
        out[name] = tensor
    return out


def load(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    expert_cache_gb: float | None = None,
    prefetch_k: int | None = None,
    host_cache_gb: float = 0.0,
    dequant_cache_gb: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
    int8_activations: bool | None = None,
    expert_parallel: bool | ExpertParallel = False,
    memory_gb: float | None = None,
) -> MoEModel:
    """Open a checkpoint: a Hugging Face safetensors directory (or a hub id found in the local
    cache) or a GGUF file.

    Placement: without `expert_cache_gb`, the model stays resident when it fits the memory it may
    use, and its experts are streamed from the checkpoint through a cache of what is left when not
    (with `prefetch_k` the model's top-k); the decision is printed in one line on stderr. That memory
    is `memory_gb` (an overall budget for the process, what it holds already included; on CUDA, of
    the device), else the memory cgroup's limit or MemAvailable (on CUDA: the free device memory).
    A model that cannot run within it is refused with the least it needs.

    `expert_cache_gb`: keep the dense part and this many GB of expert slots on the device and stream
    the other experts from the checkpoint (moerun.offload); too small a budget for one token's
    experts is refused with the minimum. `prefetch_k`: with streaming, load that many of the next
    MoE layer's predicted experts while a layer computes. `host_cache_gb`: with streaming, keep up to
    this many GB of recently read experts in host RAM (pinned on CUDA), so a re-fetched expert is a
    memory copy, not a file read. `progress(done, total)` is told as layers are placed.

    `backend`: "auto" picks triton on CUDA, on a CPU "cpu" (the native kernels, weights kept in the
    file's format) where they run, else "torch". `int8_activations`: quantise activations per block
    to int8 for integer dot products, as llama.cpp does (faster; None: on for bf16/f16 on the cpu
    backend, off for fp32, whose logits then stay within 1e-4 of the fp32 reference).

    `expert_parallel`: True (or a moerun.distributed.ExpertParallel) to hold only this rank's share
    of every MoE layer's experts, in the torch.distributed group torchrun started (joined here when
    needed); every rank must load the same checkpoint with the same options, which is checked. With
    `expert_cache_gb` too, each rank streams its own experts through its own cache of that size.

    Every setting is decided here, once, into the model's RunSpec (moerun.moe.run)."""
    if prefetch_k and expert_cache_gb is None:
        raise ValueError("prefetch_k needs expert_cache_gb: prefetching feeds the expert cache.")
    if host_cache_gb and expert_cache_gb is None:
        raise ValueError("host_cache_gb needs expert_cache_gb: the host tier serves the streamed experts.")
    if memory_gb is not None and expert_cache_gb is not None:
        raise ValueError("Give memory_gb or expert_cache_gb, not both: memory_gb chooses the expert cache.")
    if memory_gb is not None and not memory_gb > 0:
        raise ValueError(f"memory_gb must be > 0, got {memory_gb}.")
    if expert_parallel is True:
        expert_parallel = ExpertParallel.from_env(device=str(device))
    device = torch.device(device)
    root = resolve_checkpoint(path)
    modes = {None: None, True: ActivationMode.INT8, False: ActivationMode.EXACT}
    backend = make_backend(backend, device, dtype, modes[int8_activations])
    opened = _Opened.of(root)
    if expert_parallel:
        expert_parallel.check_same("checkpoint config and options", f"{opened.config!r} {dtype} {backend!r}")
    fit = None
    if not expert_parallel and expert_cache_gb is None:
        fit = choose_fit(opened, device, dtype, backend.native_linears, memory_gb)
        if fit is not None and fit.streamed:
            expert_cache_gb = fit.budget_bytes / 2**30
            prefetch_k = opened.config.moe.top_k if prefetch_k is None else prefetch_k
    streamed = expert_cache_gb is not None
    in_place = device.type == "cpu" and backend.reads_experts_in_place  # its kernels check the experts
    config, tensors, files = opened.tensors(dtype, streamed, expert_parallel or None, in_place)
    expert_cache = None
    if streamed:
        try:
            expert_cache = _expert_cache(
                config, tensors, files, dtype, device, (expert_cache_gb, host_cache_gb)
            )
        except CacheBudgetError as err:
            if fit is None or err.minimum is None:
                raise
            raise CacheBudgetError(f"{root}: {fit.too_small(err.minimum)}", err.minimum) from None
    if fit is not None:  # the decision, once it holds
        print(f"moerun: {root}: {fit.describe()}", file=sys.stderr, flush=True)
    run = RunSpec(
        device=device,
        dtype=dtype,
        backend=backend,
        dequant_cache=DequantCache(int(dequant_cache_gb * 2**30)) if dequant_cache_gb else None,
        expert_cache=expert_cache,
        prefetch_k=prefetch_k or 0,
        expert_parallel=expert_parallel or None,
    )
    # streamed experts: storage-free stand-ins; the expert store has the bytes
    model = MoEModel(config, stand_ins(tensors), run, opened.tokenizer(), progress)
    if expert_cache is not None:  # the dense part is the model's own now: its file pages may go
        expert_cache.store.drop_cached()
    elif device.type == "cpu":  # experts read in place: their pages mapped ahead of the first tokens
        populate_in_background(_routed_expert_views(model))
    return model


def _routed_expert_views(model: MoEModel) -> list[torch.Tensor]:
    """The tensors a resident model's routed experts read (views of the file where they are used
    in place, else the model's own copies, which `populate` skips)."""
    views = []
    for mlp in model.mlps:
        experts = getattr(mlp, "experts", None)
        if experts is not None:
            views += [*file_views(experts.gate_up), *file_views(experts.down)]
    return views


@dataclass
class _Opened:
    """A checkpoint opened for loading: its config, and the GGUF file or the HF directory and its
    safetensors, nothing read yet but headers."""

    root: Path
    config: ModelConfig
    gguf: GGUFFile | None = None
    directory: Path | None = None
    hf: SafetensorsCheckpoint | None = None

    @classmethod
    def of(cls, root: Path) -> _Opened:
        if root.is_file() and root.suffix == ".gguf":
            from moerun.checkpoint.gguf import gguf_model_config

            gguf = GGUFFile(root)
            return cls(root, gguf_model_config(gguf), gguf=gguf)
        directory, weights = hf_paths(root)
        return cls(root, hf_model_config(directory), directory=directory, hf=SafetensorsCheckpoint(weights))

    def tensors(
        self, dtype: torch.dtype, streamed: bool, ep: ExpertParallel | None, experts_in_place: bool = False
    ):
        """(the model config, its canonical tensors, the mapped files they view). Expert parallelism,
        resident: only this rank's experts, cut before anything is copied (streamed: the store
        describes every expert and reads only the rank's own); every rank but 0 computes only its
        experts: the rest of the checkpoint is never read there. `experts_in_place`: the backend reads
        resident experts where the file put them and checks their scales as it first uses each, so
        they are not all read here."""
        share = ep.shard(self.config.moe.num_experts) if ep is not None and not streamed else None
        experts_only = ep is not None and not ep.leads
        if self.gguf is not None:
            from moerun.checkpoint.gguf import gguf_model

            config, tensors = gguf_model(
                self.gguf, assemble=not streamed, share=share, experts_only=experts_only
            )
            _refuse_nonfinite_scales(self.gguf, tensors, experts_too=not streamed and not experts_in_place)
            return config, tensors, [MappedFile(self.gguf.path, self.gguf.mapped)]
        loaded = _hf_model(
            self.root, self.hf, self.config, dtype, streamed, share, experts_only, experts_in_place
        )
        return (self.config, *loaded)

    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None where it has none (or one moerun cannot read)."""
        if self.gguf is not None:
            if "tokenizer.ggml.model" not in self.gguf.metadata:
                return None
            source = str(self.root)
            return _tokenizer(
                lambda: Tokenizer.from_gguf_metadata(self.gguf.metadata, source=source), self.root
            )
        if not (self.directory / "tokenizer.json").is_file():
            return None
        return _tokenizer(lambda: Tokenizer.from_hf_dir(self.directory), self.directory)


def _refuse_nonfinite_scales(gguf: GGUFFile, tensors: Mapping[str, object], experts_too: bool) -> None:
    """Refuses a quantised tensor the model holds with a block whose fp16 scale is inf or NaN, which
    would make every logit NaN. Streamed experts are left to the store, which checks each expert as
    it reads it; experts the cpu backend reads in place, to it, as it first uses each. The message
    names the file's tensor and its block where the model's tensor is a view of the file."""
    quantised = []
    for name, t in tensors.items():
        if ".experts." in name and not experts_too:
            continue
        parts = (t.gate, t.up) if isinstance(t, GateUpHalves) else (t,)
        quantised += [(name, part) for part in parts if isinstance(part, QTensor) and not part.data.is_meta]
    for name, t in quantised:
        block = first_nonfinite_block(t.format, t.data)
        if block is None:
            continue
        where, block = _file_block(gguf, t, block) or (f"tensor {quote(name)} ({t.format.name})", block)
        raise TensorError(
            f"{gguf.path}: {where}: block {block} has a scale that is not a number (inf or NaN); the "
            "file is damaged or was written wrong."
        )


def _file_block(gguf: GGUFFile, t: QTensor, block: int) -> tuple[str, int] | None:
    """("tensor NAME (format)", the block's index there) for block `block` of `t` (in row-major
    order) where `t` is a view of the file; None for a copy."""
    rows = t.data.shape[:-1]
    row, column = divmod(block * t.format.block_bytes, t.data.shape[-1])
    index = [int(i) for i in torch.unravel_index(torch.tensor(row), rows)]
    address = (
        t.data.data_ptr() + sum(i * s for i, s in zip(index, t.data.stride()[:-1], strict=True)) + column
    )
    held = gguf.tensor_at(address)
    if held is None:
        return None
    return f"tensor {quote(held[0])} ({t.format.name})", held[1] // t.format.block_bytes


def _expert_cache(
    config: ModelConfig,
    tensors: dict,
    files: list[MappedFile],
    dtype: torch.dtype,
    device: torch.device,
    budgets_gb: tuple[float, float],
) -> ExpertCache:
    """The expert store over every MoE layer's projections and a cache on `device`; `budgets_gb`:
    the cache's and the host tier's."""
    budget_gb, host_gb = budgets_gb
    layers = {
        f"layers.{i}.moe": {p: tensors[f"layers.{i}.moe.experts.{p}"] for p in ("gate_up", "down")}
        for i, moe in enumerate(config.moe_layers)
        if moe
    }
    store = ExpertStore(
        layers, dtype, files, host_budget_bytes=int(host_gb * 2**30), pin=device.type == "cuda"
    )
    try:
        return ExpertCache(store, int(budget_gb * 2**30), config.moe.top_k, device)
    except BaseException:
        store.close()
        raise


def _tokenizer(read: Callable[[], Tokenizer], source: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer; one it has but moerun cannot read is reported once, not fatal:
    the model still runs on token ids."""
    try:
        return read()
    except Exception as err:  # noqa: BLE001 - whatever the tokenizer files hold, the model loads
        reason = (
            str(in_file(err, source))
            if isinstance(err, CheckpointError)
            else (f"{source}: the tokenizer cannot be read ({type(err).__name__}: {shorten(str(err), 150)}).")
        )
        warnings.warn(f"{reason} The model loads without a tokenizer (token ids only).", stacklevel=3)
        return None
