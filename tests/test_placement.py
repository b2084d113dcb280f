"""Weight placement: every weight a model computes with starts on a 64-byte boundary, whether it
comes straight out of the checkpoint's map (resident) or is a fresh copy or cache slot (streamed),
so both run a BLAS product on the same alignment. The check reads addresses, so it fails on any
CPU when placement regresses, not only on one whose BLAS sums differently by alignment."""

import torch
from hf_models import make_model, save_model

import moerun
from moerun.placement import ALIGNMENT, is_aligned, place
from moerun.quant.formats import QTensor
from moerun.quant.halves import ExpertViews, GateUpHalves


def test_a_misaligned_view_is_copied_to_an_aligned_tensor_and_an_aligned_one_is_kept():
    buffer = torch.arange(65, dtype=torch.float32)
    misaligned = buffer[1:].view(8, 8)  # 4 bytes past an aligned start
    assert misaligned.data_ptr() % ALIGNMENT == 4
    placed = place(misaligned)
    assert is_aligned(placed) and torch.equal(placed, misaligned)
    aligned = torch.randn(8, 8)
    assert place(aligned).data_ptr() == aligned.data_ptr()  # nothing copied
    owned = place(aligned, own=True)
    assert owned.data_ptr() != aligned.data_ptr() and torch.equal(owned, aligned)
    assert place(aligned, dtype=torch.bfloat16).dtype == torch.bfloat16


def _computed_with(model) -> dict[str, torch.Tensor]:
    """Every weight the model's forward pass reads, by a readable name."""
    weights = {"embed": model.embed, "lm_head": model.lm_head, "norm": model.norm}
    for i, attn in enumerate(model.attentions):
        weights.update({f"layers.{i}.attn.{k}": t for k, t in attn.t.items()})
        weights[f"layers.{i}.attn_norm"] = model.attn_norms[i]
        weights[f"layers.{i}.mlp_norm"] = model.mlp_norms[i]
    for moe in model._moes:
        for key, tensor in moe.tensors.items():
            if key.startswith("experts.") and model.expert_cache is not None:
                continue  # streamed: read from the cache's slots, below
            if isinstance(tensor, GateUpHalves | ExpertViews):
                continue  # read where the file put them by the native kernels, whose sums do not
                # depend on an address (tests/test_weights_in_place.py); BLAS gets aligned copies
            data = tensor.data if isinstance(tensor, QTensor) else tensor
            if key in ("experts.gate_up", "experts.down"):
                weights.update({f"{moe.name}.{key}[{e}]": data[e] for e in range(data.shape[0])})
            else:
                weights[f"{moe.name}.{key}"] = data
    if model.expert_cache is not None:
        for moe in model._moes:
            for name, pool in model.expert_cache.pool_buffers(moe.name).items():
                if name in ("gate_up", "down"):
                    weights.update({f"{moe.name} slot {s} {name}": pool[s] for s in range(pool.shape[0])})
    return weights


def test_resident_and_streamed_models_compute_with_aligned_weights(tmp_path):
    checkpoint = save_model(make_model("olmoe"), tmp_path / "olmoe")
    # the checkpoint's map puts tensors at 8-byte offsets: what a resident model would read
    # unaligned if placement did not copy them
    for kwargs in ({}, {"expert_cache_gb": 1.0}):
        model = moerun.load(checkpoint, dtype=torch.float32, **kwargs)
        weights = _computed_with(model)
        assert any("slot" in name for name in weights) == bool(kwargs)
        misaligned = {name: t.data_ptr() % ALIGNMENT for name, t in weights.items() if not is_aligned(t)}
        assert not misaligned, (kwargs, misaligned)


def test_a_copy_off_a_file_map_gives_its_pages_back_and_other_memory_is_left_alone(tmp_path):
    from moerun.loader.mapped import map_file, release_mapped

    values = torch.randn(4 * 4096 + 3)
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    mapped = map_file(path)
    view = mapped[4:].view(torch.float32)[:4096]  # 4 bytes past a page: never 64-byte aligned
    view.sum()  # touch every page
    rss = _rss_of(view)
    placed = place(view)
    assert is_aligned(placed) and torch.equal(placed, values[1:4097])
    assert _rss_of(view) < rss  # the view's whole pages were dropped ...
    assert torch.equal(view, values[1:4097])  # ... and read back from the file when touched again
    anonymous = torch.randn(8 * 4096)
    kept = anonymous.clone()
    release_mapped(anonymous)  # not a map: dropping its pages would zero them
    assert torch.equal(anonymous, kept)


def _rss_of(view: torch.Tensor) -> int:
    """kB resident of the mapping that holds the view (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.readlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(part, 16) for part in head.split("-"))
            inside = begin <= view.data_ptr() < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("the view's map is not in /proc/self/smaps")


def test_populate_maps_a_file_maps_pages_ahead_and_leaves_other_memory_alone(tmp_path):
    """`populate` faults a map's pages in before anything touches them (the kernel's count of the
    mapping's resident pages, from /proc/self/smaps, goes from none to all of the view's), without
    changing a byte; tensors that are not views of a map are skipped."""
    from moerun.loader.mapped import map_file, populate

    values = torch.randn(64 * 4096)  # 1 MiB: 256 pages
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    mapped = map_file(path)
    view = mapped[4096:].view(torch.float32)  # the last 255 pages
    assert _rss_of(view) < 16  # kB: nothing touched yet
    anonymous = torch.randn(1000)
    assert populate([view, anonymous, view[:10]])
    assert _rss_of(view) >= 255 * 4
    assert torch.equal(view, values[1024:]) and torch.equal(mapped.view(torch.float32), values)
