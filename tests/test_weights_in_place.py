"""Weights used where the file puts them (moerun.quant.halves, the cpu backend's expert table): GGUF
gate and up experts are never joined into a copy on the native CPU path, and the kernels read rows
at any address with the same bits as from a joined, aligned copy."""

import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch
from gguf_from_hf import _metadata, random_blocks, write_gguf
from test_gguf_formats import hf_model

import moerun
from moerun import cpu
from moerun.activations import GLU, GptOssSwiGLU
from moerun.cpu import reference
from moerun.cpu.library import FORMAT_IDS
from moerun.loader import GGUFFile
from moerun.quant.halves import GateUpHalves

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels are not available")


def _at_offset(data: torch.Tensor, offset: int) -> torch.Tensor:
    """`data` copied to start `offset` bytes past a 64-byte boundary."""
    buffer = torch.empty(data.numel() + 128, dtype=torch.uint8)
    start = (-buffer.data_ptr()) % 64 + offset
    out = buffer[start : start + data.numel()].view(data.shape)
    out.copy_(data)
    return out


@pytest.mark.parametrize("act", [GLU("silu"), GptOssSwiGLU(alpha=1.702, limit=7.0)], ids=["glu", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 9])  # one token's row kernels; the prefill GEMM's lanes
@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "iq4_xs"])
def test_halves_stored_apart_at_any_address_give_the_joined_weights_bits(act, tokens, fmt):
    """Experts whose gate and up rows lie apart, at odd addresses (as a file's 32-byte or any
    alignment puts them), against the same bytes joined into one aligned [2I, H] weight each (the
    layout the list API and the expert cache's slots use): the same bits. The joined run is also
    checked against the float64 reference, so neither layout is its own oracle."""
    E, I, H = 3, 256, 256  # noqa: E741
    gen = torch.Generator().manual_seed(3)
    gate, up, down = (
        random_blocks(fmt, (E, n, k), 0.1, seed=s) for s, (n, k) in enumerate(((I, H), (I, H), (H, I)))
    )
    joined = GateUpHalves(gate, up, act.interleaved).joined()
    bias = torch.randn(E, 2 * I, generator=gen) * 0.1
    x = torch.randn(tokens, H, generator=gen)
    slot_expert = torch.stack(
        [torch.randperm(E, generator=gen)[:2].sort().values for _ in range(tokens)]
    ).int()
    weight = torch.rand(tokens, 2, generator=gen)
    whole = cpu.moe_decode(
        x, [(fmt, joined.data[e]) for e in range(E)], [(fmt, down.data[e]) for e in range(E)],
        (slot_expert, weight), act, integer=True, biases=(list(bias), [None] * E),
    )  # fmt: skip

    apart = [_at_offset(part.data, offset) for part, offset in ((gate, 1), (up, 37))]
    kernel_bias = bias.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2) if act.interleaved else bias
    kernel_bias = kernel_bias.contiguous()
    row = apart[0].stride(1)
    addresses = [(apart[0][e], apart[1][e], down.data[e], kernel_bias[e]) for e in range(E)]
    pointers = [[g.data_ptr(), u.data_ptr(), row, d.data_ptr(), b.data_ptr(), 0] for g, u, d, b in addresses]
    pointers = torch.tensor(pointers, dtype=torch.int64)
    formats = torch.tensor([[FORMAT_IDS[fmt]] * 2] * E, dtype=torch.int32)
    table = cpu.ExpertTable(pointers, formats, I)
    got = cpu.moe_decode_table(x, table, (slot_expert, weight.contiguous()), act, integer=True)
    assert torch.equal(got, whole)

    want = reference.moe_decode(  # float64
        x, [(fmt, joined.data[e]) for e in range(E)], [(fmt, down.data[e]) for e in range(E)],
        (slot_expert, weight), act, integer=True, biases=(list(bias), [None] * E),
    )  # fmt: skip
    assert torch.allclose(got.double(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_a_resident_gguf_model_reads_its_experts_from_the_file_map(model_type, tmp_path):
    """On the cpu backend every MoE layer's gate and up experts are views of the file's map, not
    copies, and its logits equal the torch backend's (which joins them) within fp32's tolerance."""
    model = hf_model(model_type)  # rows of whole blocks
    path = tmp_path / "m.gguf"
    write_gguf(model, path, "q8_0")
    loaded = moerun.load(path, backend="cpu", dtype=torch.float32, int8_activations=False)
    mapped = GGUFFile(path).mapped
    begin, end = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()  # a second map of the same file
    for mlp in loaded.mlps:
        halves = mlp.experts.gate_up
        assert isinstance(halves, GateUpHalves)
        for part in (halves.gate.data, halves.up.data):
            storage = part.untyped_storage()
            assert storage.nbytes() == os.path.getsize(path)  # the whole file's map, not a copy
            assert not (begin <= part.data_ptr() < end)  # (and not the other map)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    joined = moerun.load(path, backend="torch", dtype=torch.float32)
    assert not isinstance(joined.mlps[0].experts.gate_up, GateUpHalves)
    assert torch.allclose(loaded.logits(ids), joined.logits(ids), rtol=1e-4, atol=1e-4)


def _write_big_qwen3moe(path, layers: int, experts: int, hidden: int, inter: int) -> int:
    """A qwen3moe GGUF whose experts are random valid q8_0 blocks (hundreds of MB, written without a
    transformers model); the rest small and f32. Returns the experts' bytes."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=experts, num_experts_per_tok=4, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    _metadata(writer, config, "qwen3_moe")
    rng = np.random.default_rng(0)

    def dense(name, *shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    dense("token_embd.weight", 256, hidden)
    dense("output_norm.weight", hidden)
    dense("output.weight", 256, hidden)
    expert_bytes = 0
    for b in range(layers):
        for name, shape in (
            ("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q_norm", (32,)), ("attn_k_norm", (32,)),
            ("attn_q", (128, hidden)), ("attn_k", (64, hidden)), ("attn_v", (64, hidden)),
            ("attn_output", (hidden, 128)), ("ffn_gate_inp", (experts, hidden)),
        ):  # fmt: skip
            dense(f"blk.{b}.{name}.weight", *shape)
        for name, shape in (
            ("ffn_gate_exps", (experts, inter, hidden)),
            ("ffn_up_exps", (experts, inter, hidden)),
            ("ffn_down_exps", (experts, hidden, inter)),
        ):
            blocks = rng.integers(-128, 128, (int(np.prod(shape)) // 32, 34), dtype=np.int8).view(np.uint8)
            blocks[:, :2] = np.array([1e-3], np.float16).view(np.uint8)  # each block's scale d
            rows = blocks.reshape(*shape[:-1], shape[-1] // 32 * 34)
            writer.add_tensor(f"blk.{b}.{name}.weight", rows, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            expert_bytes += blocks.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expert_bytes


_MEASURE = textwrap.dedent(
    """
    import sys, torch, moerun, moerun.cpu
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    moerun.cpu.available()
    torch.zeros(1) @ torch.zeros(1)
    before = anon()
    model = moerun.load(sys.argv[1], backend="cpu", dtype=torch.float32)
    model.logits(torch.tensor([[5, 7, 11, 13, 17, 19, 23, 29]]))
    print(anon() - before)
    """
)


def test_loading_a_resident_gguf_model_copies_none_of_its_experts(tmp_path):
    """The anonymous-memory bound, from /proc: a model whose experts are 200 MB adds far less than
    them to the process's anonymous memory (its experts stay file-backed pages, which the OS can drop
    and read again), where joining gate and up used to copy two thirds of them."""
    path = tmp_path / "big.gguf"
    expert_bytes = _write_big_qwen3moe(path, layers=6, experts=64, hidden=512, inter=512)
    assert expert_bytes > 150 * 2**20
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, check=True, timeout=300
    )
    added = int(out.stdout.split()[-1])
    assert added < 48 * 2**20, f"loading added {added / 2**20:.0f} MiB of anonymous memory"


def _views_of_the_file(weight, path) -> bool:
    """Whether every matrix of `weight` (ExpertViews) is a view of the map of the file at `path`."""
    return all(v.untyped_storage().nbytes() == os.path.getsize(path) for v in weight.views)


@pytest.mark.parametrize(
    "dtype, integer",
    [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["fp32", "bf16", "bf16-int8"],
)
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_a_resident_hf_model_reads_each_experts_tensors_from_the_file_map(
    model_type, dtype, integer, tmp_path, monkeypatch
):
    """A Hugging Face checkpoint stores every expert's gate, up and down as tensors of their own. On
    the cpu backend, in the file's dtype, they stay views of the file's map (no stacked copy), and
    the logits of a prompt (the prefill path) and of decode steps are bitwise those of the same
    model with its experts stacked into copies as before; in fp32 they equal transformers' within
    1e-4 as well."""
    from hf_models import hf_logits, make_model, save_model

    from moerun.moe import layer as moe_layer
    from moerun.quant.halves import ExpertViews

    model = make_model(model_type)
    save_model(model.to(dtype), tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    load = dict(backend="cpu", dtype=dtype, int8_activations=integer)
    in_place = moerun.load(tmp_path, **load)
    for mlp in in_place.mlps:
        if not hasattr(mlp, "experts"):  # a dense MLP layer
            continue
        halves, down = mlp.experts.gate_up, mlp.experts.down
        assert isinstance(halves, GateUpHalves) and isinstance(down, ExpertViews)
        assert all(_views_of_the_file(w, path) for w in (halves.gate, halves.up, down))
    monkeypatch.setattr(moe_layer, "_used_in_place", lambda weight, run: False)
    copied = moerun.load(tmp_path, **load)
    assert not any(isinstance(m.experts.gate_up, GateUpHalves) for m in copied.mlps if hasattr(m, "experts"))

    prompt = torch.randint(0, in_place.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(in_place.logits(prompt), copied.logits(prompt))  # 24 tokens: torch's GEMMs
    steps = [[t.id for t in m.generate(prompt[0].tolist(), 6)] for m in (in_place, copied)]
    assert steps[0] == steps[1] and in_place.stats()["new_tokens"] == 6
    one = prompt[:, :1]
    assert torch.equal(in_place.logits(one), copied.logits(one))  # one token: the native step
    if dtype == torch.float32:
        want = hf_logits(model, prompt)
        assert torch.allclose(in_place.logits(prompt), want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_loading_a_resident_hf_model_copies_none_of_its_experts(tmp_path):
    """The anonymous-memory bound for a Hugging Face checkpoint, from /proc: experts of 300 MB, each
    expert's tensors stored apart, add far less than them to the process's anonymous memory, where
    stacking them used to copy all of them."""
    from hf_models import make_model, save_model

    shape = dict(hidden_size=256, moe_intermediate_size=256, num_experts=64, num_hidden_layers=6, head_dim=32)
    model = make_model("qwen3_moe", **shape)
    expert_bytes = sum(p.numel() * 4 for name, p in model.named_parameters() if ".experts." in name)
    assert expert_bytes > 250 * 2**20
    save_model(model, tmp_path)
    del model
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    added = int(out.stdout.split()[-1])
    assert added < 48 * 2**20, f"loading added {added / 2**20:.0f} MiB of anonymous memory"
