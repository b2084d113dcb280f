"""Layer behaviour beyond the oracles: determinism, untouched experts, bad tensors, tracing."""

import subprocess
import sys

import pytest
import torch
from hf_blocks import H, make_block

from moerun.families.moe_block import layer_from_transformers
from moerun.moe.layer import StateDictError


@pytest.mark.parametrize("tokens", [1, 64])
def test_same_input_gives_bitwise_same_output(tokens):
    block, config = make_block("qwen2_moe")
    layer = layer_from_transformers("qwen2_moe", config, block.state_dict())
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(0))
    first = layer(x)
    again = layer_from_transformers("qwen2_moe", config, block.state_dict())(x.clone())
    assert torch.equal(first, layer(x))
    assert torch.equal(first, again)


_RUN_ONCE = """
import sys, torch
sys.path.insert(0, 'tests')
from hf_blocks import H, make_block
from moerun.families.moe_block import layer_from_transformers
block, config = make_block('deepseek_v3')
x = torch.randn(97, H, generator=torch.Generator().manual_seed(0))
out = layer_from_transformers('deepseek_v3', config, block.state_dict(), dtype=torch.bfloat16)(x.bfloat16())
sys.stdout.write(out.float().numpy().tobytes().hex())
"""


def test_bitwise_same_output_across_processes():
    runs = [
        subprocess.run([sys.executable, "-c", _RUN_ONCE], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    assert runs[0] and runs[0] == runs[1]


@pytest.mark.parametrize("tokens", [1, 5])
def test_only_routed_experts_are_touched(tokens):
    """Poisoning the weights of every expert the router did not pick must not change the output."""
    block, config = make_block("olmoe")
    state = block.state_dict()
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(4))
    layer = layer_from_transformers("olmoe", config, state)
    expected = layer(x)
    logits = x @ state["gate.weight"].T
    chosen = set(logits.topk(config["num_experts_per_tok"], dim=-1).indices.flatten().tolist())
    unused = [e for e in range(config["num_experts"]) if e not in chosen]
    assert unused, "the test needs at least one expert without rows"
    poisoned = {k: v.clone() for k, v in state.items()}
    for e in unused:
        poisoned["experts.gate_up_proj"][e] = float("nan")
        poisoned["experts.down_proj"][e] = float("nan")
    out = layer_from_transformers("olmoe", config, poisoned)(x)
    assert torch.equal(out, expected)


def test_bad_state_dict_lists_every_problem():
    block, config = make_block("qwen2_moe")
    state = dict(block.state_dict())
    del state["gate.weight"]
    del state["shared_expert.up_proj.weight"]
    state["experts.down_proj"] = state["experts.down_proj"][:, :, :-1]
    state["shared_expert_gate.weight"] = state["shared_expert_gate.weight"].long()
    state["experts.extra"] = torch.zeros(1)
    with pytest.raises(StateDictError) as err:
        layer_from_transformers("qwen2_moe", config, state, name="layers.5.mlp")
    message = str(err.value)
    for expected in [
        "layers.5.mlp",
        "missing router.weight (gate.weight)",
        "shared.gate_up (shared_expert.gate_proj.weight + shared_expert.up_proj.weight)",
        "experts.down (experts.down_proj) is (8, 32, 23), expected (8, 32, 24)",
        "shared.gate (shared_expert_gate.weight)",
        "unexpected experts.extra",
    ]:
        assert expected in message


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match="model_type='llama4_moe'"):
        layer_from_transformers("llama4_moe", {}, {})


def test_trace_prints_stages_and_router_figures(trace_env, capsys):
    block, config = make_block("mixtral")
    layer = layer_from_transformers("mixtral", config, block.state_dict(), name="layers.1.moe")
    x = torch.randn(9, H)
    trace_env(None)
    quiet = layer(x)
    assert capsys.readouterr().err == ""
    trace_env("perf,buffers")
    loud = layer(x)
    err = capsys.readouterr().err
    assert torch.equal(quiet, loud)
    perf = [line for line in err.splitlines() if line.startswith("[moerun perf] layers.1.moe T=9")]
    assert len(perf) == 1
    for stage in ("route=", "plan=", "experts=", "combine="):
        assert stage in perf[0]
    logits = x @ block.state_dict()["gate.weight"].T
    figures = [line for line in err.splitlines() if "ids_out_of_range=0" in line]
    assert len(figures) == 1
    assert f"max={logits.max().item():.4g}" in figures[0] and "nan=0" in figures[0]


def test_trace_shows_nan_count_before_the_error(trace_env, capsys):
    block, config = make_block("mixtral")
    layer = layer_from_transformers("mixtral", config, block.state_dict())
    x = torch.randn(3, H)
    x[0] = float("nan")
    trace_env("buffers")
    with pytest.raises(ValueError):
        layer(x)
    assert f"nan={config['num_local_experts']}" in capsys.readouterr().err


def test_unknown_trace_channel_is_refused(trace_env):
    from moerun.settings import settings

    trace_env("perf,flops")
    with pytest.raises(ValueError, match="MOERUN_TRACE.*flops"):
        settings()


@pytest.mark.parametrize("model_type", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_export_inverts_sanitize(model_type):
    """The bench's peer gets its weights through export(); it must give back transformers' tensors."""
    from moerun.families.moe_block import export, sanitize

    block, _ = make_block(model_type)
    state = block.state_dict()
    tensors, _ = sanitize(model_type, state)
    exported = export(model_type, tensors)
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
