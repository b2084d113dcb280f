"""Whole models with expert streaming against the same models with every expert resident: logits
bitwise equal (prefill and decode) for any cache that holds one token's experts, per family and
format, with every expert read from the checkpoint file (never joined in RAM at load, whatever the
layout: per-expert names, GGUF gate and up apart or fused, GPT-OSS MXFP4 blocks and scales); the
budget floor; prefetch; stats; and a checkpoint truncated under a running model."""

import re

import pytest
import torch
from gguf_from_hf import write_gguf
from hf_models import VOCAB, make_model, save_gpt_oss_mxfp4, save_model

import moerun
from moerun.offload import CacheBudgetError, ExpertReadError

CASES = {
    "olmoe-per-expert-names": lambda tmp: save_model(make_model("olmoe"), tmp / "olmoe"),
    "qwen2_moe-fused-names": lambda tmp: save_model(make_model("qwen2_moe"), tmp / "qwen2", False),
    "gpt_oss-transposed": lambda tmp: save_model(make_model("gpt_oss"), tmp / "gpt_oss"),
    "gpt_oss-mxfp4": lambda tmp: save_gpt_oss_mxfp4(
        make_model("gpt_oss", hidden_size=64, intermediate_size=32), tmp / "mxfp4"
    ),
    "olmoe-gguf-q4_k-gate-up-apart": lambda tmp: _gguf(tmp / "olmoe.gguf"),
    "gpt_oss-gguf-mxfp4-interleaved": lambda tmp: _gpt_oss_gguf(tmp / "gpt_oss.gguf", experts="mxfp4"),
    "gpt_oss-gguf-f32-gate-up-fused": lambda tmp: _gpt_oss_gguf(tmp / "gpt_oss.gguf", fuse_gate_up=True),
}


def _gguf(path):
    model = make_model("olmoe", hidden_size=256, intermediate_size=256, num_experts=4, num_hidden_layers=2)
    write_gguf(model, path, "q4_k")
    return path


def _gpt_oss_gguf(path, **layout):
    """gpt-oss as llama.cpp stores it: gate and up experts apart (or fused, gate rows then up rows);
    moerun interleaves their rows."""
    model = make_model("gpt_oss", hidden_size=64, intermediate_size=32, swiglu_limit=7.0)
    write_gguf(model, path, **layout)
    return path


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return CASES[request.param](tmp_path_factory.mktemp(request.param))


def _minimum_gb(path, dtype) -> tuple[float, int]:
    """The budget floor, as the refusal of a too-small budget states it."""
    with pytest.raises(CacheBudgetError, match="cannot hold one token's") as info:
        moerun.load(path, dtype=dtype, expert_cache_gb=1e-9)
    gb, nbytes = re.search(
        r"minimum is expert_cache_gb=([\d.e+-]+) \((\d+) bytes\)", str(info.value)
    ).groups()
    return float(gb), int(nbytes)


def _decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of each position fed one token at a time (the decode path), [T, V]."""
    cache = model.new_cache(1, ids.shape[1])
    with torch.inference_mode():
        return torch.cat(
            [model.hidden_logits(model.forward(ids[:, t : t + 1], cache))[0] for t in range(ids.shape[1])]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_with_any_cache_size_equal_all_resident(checkpoint, dtype):
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    resident = moerun.load(checkpoint, dtype=dtype)
    want_prefill, want_decode = resident.logits(ids), _decode_logits(resident, ids)
    floor_gb, floor_bytes = _minimum_gb(checkpoint, dtype)
    k = resident.config.moe.top_k
    slot = floor_bytes // k
    every = slot * resident.config.moe.num_experts * sum(resident.config.moe_layers)
    for budget in (floor_bytes, (floor_bytes + every) // 2, every):
        model = moerun.load(checkpoint, dtype=dtype, expert_cache_gb=budget / 2**30)
        store = model.expert_cache.store
        # every expert projection is read from the file, none joined or copied into RAM at load
        assert all(all(store.file_backed(layer).values()) for layer in store.sources)
        assert model.expert_cache.num_slots == budget // slot
        assert torch.equal(model.logits(ids), want_prefill), budget
        assert torch.equal(_decode_logits(model, ids), want_decode), budget
        model.expert_cache.verify()
        model.close()
    # the stated figure is enough, and within 0.1% of the floor
    assert floor_bytes <= int(floor_gb * 2**30) <= 1.001 * floor_bytes
    moerun.load(checkpoint, dtype=dtype, expert_cache_gb=floor_gb).close()


def test_prefetch_changes_nothing_but_the_counters(checkpoint):
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    want = _decode_logits(moerun.load(checkpoint, dtype=torch.float32), ids)
    _, floor = _minimum_gb(checkpoint, torch.float32)
    model = moerun.load(checkpoint, dtype=torch.float32, expert_cache_gb=2 * floor / 2**30, prefetch_k=2)
    assert torch.equal(_decode_logits(model, ids), want)
    total = model.stats()["offload"]["total"]
    assert total["prefetch_issued"] > 0
    assert total["prefetch_used"] + total["prefetch_wasted"] <= total["prefetch_issued"]
    assert total["steps"] == 10
    model.close()


def test_stats_per_step_and_in_total(tmp_path):
    path = CASES["olmoe-per-expert-names"](tmp_path)
    model = moerun.load(path, dtype=torch.float32, expert_cache_gb=1.0)  # holds every expert
    tokens = list(model.generate([1, 2, 3], max_new_tokens=4))
    stats = model.stats()["offload"]
    total, last = stats["total"], stats["last_step"]
    moe_layers, k = sum(model.config.moe_layers), model.config.moe.top_k
    assert total["steps"] == len(tokens)  # prefill, then one step per new token but the last
    assert last["hits"] + last["misses"] == moe_layers * k  # a decode step asks each layer for k
    assert total["misses"] <= moe_layers * model.config.moe.num_experts  # never reloaded: all fit
    assert total["bytes_read"] == total["misses"] * (stats["cache_bytes"] // stats["slots"])
    assert total["fetch_ms"] > 0 and total["compute_ms"] > 0 and total["route_ms"] > 0
    model.close()


def test_prefetch_needs_a_cache(tmp_path):
    with pytest.raises(ValueError, match="prefetch_k needs expert_cache_gb"):
        moerun.load(CASES["olmoe-per-expert-names"](tmp_path), prefetch_k=2)


def test_a_checkpoint_truncated_under_a_running_model_gives_a_clear_error(tmp_path):
    path = _gguf(tmp_path / "model.gguf")
    _, floor = _minimum_gb(path, torch.float32)
    model = moerun.load(path, dtype=torch.float32, expert_cache_gb=floor / 2**30)
    assert model.expert_cache.store.file_backed("layers.0.moe")["down"]  # GGUF down: read from the file
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    model.logits(ids)
    with open(path, "r+b") as handle:
        handle.truncate(1024)  # every tensor's bytes gone
    with pytest.raises(ExpertReadError, match="truncated or replaced"):
        for _ in range(5):  # two slots for four experts: the cache must reload soon
            model.logits(torch.randint(0, VOCAB, (1, 6)))
    model.close()


def test_prefetch_of_a_perfectly_predictable_model_turns_every_miss_into_a_hit(tmp_path):
    """Prediction itself, checked where its answer is known: with attention and expert outputs zero
    the hidden state never changes, and with every layer's router and norm equal, the next layer's
    router on the current hidden state picks exactly the experts that layer will ask for. Then every
    expert of the layers after the first is prefetched (no miss there, none wasted), where the same
    run without prefetch misses them."""
    hf = make_model("olmoe", num_experts=8, num_experts_per_tok=2)
    state = hf.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            if name.endswith(("self_attn.o_proj.weight", "mlp.experts.down_proj")):
                tensor.zero_()
            if ".layers." in name and not name.startswith("model.layers.0."):
                first = re.sub(r"\.layers\.\d+\.", ".layers.0.", name)
                if name.endswith(("mlp.gate.weight", "post_attention_layernorm.weight")):
                    tensor.copy_(state[first])
    path = save_model(hf, tmp_path / "predictable")
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    _, floor = _minimum_gb(path, torch.float32)
    layers, k = hf.config.num_hidden_layers, hf.config.num_experts_per_tok
    runs = {}
    for prefetch in (None, k):
        # room for two tokens' experts per layer: the prefetched ones next to those still pinned
        model = moerun.load(path, dtype=torch.float32, expert_cache_gb=2 * floor / 2**30, prefetch_k=prefetch)
        _decode_logits(model, ids)
        runs[prefetch] = model.stats()["offload"]["total"]
        model.close()
    without, with_prefetch = runs[None], runs[k]
    assert with_prefetch["prefetch_wasted"] == 0 and with_prefetch["prefetch_paused"] == 0
    assert with_prefetch["prefetch_used"] == with_prefetch["prefetch_issued"] > 0
    # layer 0 is never predicted, so its misses stay; every later layer's misses are prefetched
    assert with_prefetch["misses"] + with_prefetch["prefetch_used"] == without["misses"]
    assert with_prefetch["misses"] < without["misses"] and layers > 1


_GENERATE_UNTIL_INTERRUPTED = r"""
import sys, torch, moerun
model = moerun.load(sys.argv[1], dtype=torch.float32, expert_cache_gb=float(sys.argv[2]), prefetch_k=2)
for i, token in enumerate(model.generate([1, 2, 3], max_new_tokens=10**6)):
    if i == 2:
        print("ready", flush=True)
"""


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGINT"), reason="needs POSIX signals")
def test_ctrl_c_mid_generation_exits_without_hanging(tmp_path):
    """Ctrl-C while experts stream: the interrupt reaches the user and the process exits, its reader
    threads stopped (a hung reader would keep the interpreter from exiting)."""
    import signal
    import subprocess
    import sys

    path = CASES["olmoe-per-expert-names"](tmp_path)
    floor_gb, _ = _minimum_gb(path, torch.float32)
    proc = subprocess.Popen(
        [sys.executable, "-c", _GENERATE_UNTIL_INTERRUPTED, str(path), str(2 * floor_gb)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err
    assert proc.returncode != 0


def test_host_ram_tier_serves_refetched_experts_without_reading_the_file(tmp_path):
    path = CASES["olmoe-per-expert-names"](tmp_path)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    want = _decode_logits(moerun.load(path, dtype=torch.float32), ids)
    floor_gb, floor = _minimum_gb(path, torch.float32)
    model = moerun.load(path, dtype=torch.float32, expert_cache_gb=floor_gb, host_cache_gb=1.0)
    assert torch.equal(_decode_logits(model, ids), want)
    total = model.stats()["offload"]["total"]
    per_expert = floor // model.config.moe.top_k
    distinct = sum(model.config.moe_layers) * model.config.moe.num_experts
    assert total["misses"] > distinct  # the smallest cache evicts and fetches again
    assert total["bytes_read"] <= distinct * per_expert  # every expert read from the file once at most
    model.close()
    with pytest.raises(ValueError, match="host_cache_gb needs expert_cache_gb"):
        moerun.load(path, host_cache_gb=1.0)
