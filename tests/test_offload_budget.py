"""The expert cache budget chosen when none is given: the rule on plain byte counts, and `load` on a
device that (by a patched free-memory figure) is too small for the model, which then streams and
says so, with logits bitwise those of the resident model."""

import importlib

import pytest
import torch
from hf_models import VOCAB, make_model, save_model

import moerun
from moerun.loader import SafetensorsCheckpoint
from moerun.offload import CacheBudgetError
from moerun.offload.budget import MARGIN_BYTES, auto_budget, free_device_memory

GB = 2**30
load_module = importlib.import_module("moerun.checkpoint.load")


def test_a_model_that_fits_stays_resident():
    fit = auto_budget(free_bytes=80 * GB, dense_bytes=10 * GB, expert_bytes=60 * GB, kv_bytes=2 * GB)
    assert fit.budget_bytes is None
    assert fit.margin_bytes == 4 * GB  # 5% of the free memory, above the 1 GB floor


def test_a_model_too_big_gets_what_is_left_after_dense_kv_and_margin():
    fit = auto_budget(free_bytes=24 * GB, dense_bytes=5 * GB, expert_bytes=60 * GB, kv_bytes=GB)
    assert fit.margin_bytes == int(0.05 * 24 * GB)
    assert fit.budget_bytes == 24 * GB - 5 * GB - GB - fit.margin_bytes
    text = fit.describe()
    assert "65.00 GB" in text and "24.00 GB free" in text and "expert_cache_gb=16.8 " in text


def test_the_margin_is_at_least_a_gigabyte():
    fit = auto_budget(free_bytes=8 * GB, dense_bytes=2 * GB, expert_bytes=30 * GB, kv_bytes=GB)
    assert fit.margin_bytes == MARGIN_BYTES == GB
    assert fit.budget_bytes == 4 * GB


def test_no_room_at_all_gives_a_zero_budget_for_the_cache_to_refuse():
    fit = auto_budget(free_bytes=4 * GB, dense_bytes=5 * GB, expert_bytes=30 * GB, kv_bytes=GB)
    assert fit.budget_bytes == 0


def test_a_cpu_reports_no_free_memory():
    assert free_device_memory(torch.device("cpu")) is None


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return save_model(make_model("olmoe"), tmp_path_factory.mktemp("olmoe") / "olmoe")


def _free_for(path, dtype, expert_share: float) -> int:
    """A free-memory figure leaving room for `expert_share` of the experts after the rest."""
    dense, experts = load_module._hf_bytes(SafetensorsCheckpoint(path), dtype)
    kv = load_module._kv_reserve_bytes(load_module.hf_model_config(path), dtype)
    return MARGIN_BYTES + dense + kv + int(expert_share * experts)


def test_load_streams_on_a_device_too_small_and_says_so(olmoe, monkeypatch, capsys):
    dtype = torch.float32
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    resident = moerun.load(olmoe, dtype=dtype)  # the CPU reports nothing: resident, as always
    assert resident.expert_cache is None
    want = resident.logits(ids)
    free = _free_for(olmoe, dtype, 0.5)
    monkeypatch.setattr(load_module, "free_device_memory", lambda device: free)
    model = moerun.load(olmoe, dtype=dtype)
    line = capsys.readouterr().err.strip()
    assert model.expert_cache is not None
    assert "streaming experts with expert_cache_gb=" in line and line.count("\n") == 0
    budget = float(line.split("expert_cache_gb=")[1].split()[0]) * GB
    assert model.expert_cache.nbytes <= budget * 1.001
    all_experts = model.config.moe.num_experts * sum(model.config.moe_layers)
    assert 0 < model.expert_cache.num_slots < all_experts
    assert torch.equal(model.logits(ids), want)
    model.close()


def test_load_keeps_a_model_that_fits_resident(olmoe, monkeypatch, capsys):
    monkeypatch.setattr(
        load_module, "free_device_memory", lambda device: _free_for(olmoe, torch.float32, 1.5)
    )
    model = moerun.load(olmoe, dtype=torch.float32)
    assert model.expert_cache is None
    assert capsys.readouterr().err == ""


def test_load_on_a_device_too_small_even_to_stream_says_what_does_not_fit(olmoe, monkeypatch):
    monkeypatch.setattr(load_module, "free_device_memory", lambda device: MARGIN_BYTES)
    with pytest.raises(
        CacheBudgetError, match=r"does not fit the device: .* the minimum is expert_cache_gb="
    ):
        moerun.load(olmoe, dtype=torch.float32)
