"""`moerun bench --model` on a tiny model: it runs, and its two contenders agree (they share weights)."""

import torch
from hf_models import TINY_OLMOE

from moerun.bench.model import build_pair, format_model_table, run_model_bench


def test_the_pair_shares_weights_and_agrees_in_fp32():
    peer, ours = build_pair(2, torch.float32, TINY_OLMOE)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        theirs = peer(ids).logits.float()
        mine = ours.logits(ids)
    assert ((mine - theirs).abs().max() / theirs.abs().max()).item() <= 1e-4
    assert ours.embed.data_ptr() == peer.model.embed_tokens.weight.data_ptr()  # shared, not copied


def test_model_bench_reports_both_contenders():
    r = run_model_bench(layers=1, dtype="fp32", prompt_tokens=16, decode_steps=2, repeats=1, shape=TINY_OLMOE)
    assert r["peer_max_rel_diff"] <= 1e-4 and r["same_greedy_last_token"]
    assert r["prefill_tok_s"] > 0 and r["decode_vs_peer"] > 0
    assert "decode" in format_model_table(r)
