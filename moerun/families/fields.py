"""The config keys moerun reads, each with the kind of value it must hold and its allowed range
(`FIELDS`: one row a key), and `CheckedConfig`: a checkpoint's config dict as the family files read
it, every value checked against its row as it is read. A required key that is missing, a value of
the wrong type or out of range is one ConfigError naming the key, its value and what is allowed,
before anything is sized or looped by it. The bounds on counts are sane ones that no real model comes
near (at most 1024 layers, 65536 experts, 2**22 tokens of vocabulary, ...), so a corrupt count is
refused instead of allocated.

The loaders name the file (config.json, or the GGUF file whose metadata is read as a config); GGUF
metadata keys are spelled as the file has them (`names`)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from numbers import Integral, Real

from moerun.activations import HF_ACTIVATIONS
from moerun.errors import ConfigError, quote


@dataclass(frozen=True)
class Count:
    """An integer in [low, high]; `nullable`: null means "not set"."""

    low: int
    high: int
    nullable: bool = True

    def check(self, value) -> int | None:
        if isinstance(value, Integral) and not isinstance(value, bool) and self.low <= value <= self.high:
            return int(value)
        raise _Wrong(f"an integer in [{self.low}, {self.high}]")


@dataclass(frozen=True)
class Number:
    """A finite number in (low, high] (`low_open`) or [low, high]."""

    low: float
    high: float
    low_open: bool = True
    nullable: bool = True

    def check(self, value) -> float | int:
        try:
            ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
        except OverflowError:  # an integer too large for a float
            ok = False
        if ok and (value > self.low if self.low_open else value >= self.low) and value <= self.high:
            return value
        raise _Wrong(f"a finite number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]")


@dataclass(frozen=True)
class Flag:
    nullable: bool = True

    def check(self, value) -> bool:
        if isinstance(value, bool):
            return value
        raise _Wrong("true or false")


@dataclass(frozen=True)
class Choice:
    values: tuple[str, ...]
    nullable: bool = True

    def check(self, value) -> str:
        if isinstance(value, str) and value in self.values:
            return value
        raise _Wrong(f"one of {list(self.values)}")


@dataclass(frozen=True)
class Ids:
    """A token id, or a list of them (eos_token_id)."""

    nullable: bool = True

    def check(self, value):
        ids = value if isinstance(value, list) else [value]
        if len(ids) <= 1024 and all(_is_int(i) and 0 <= i < 2**31 for i in ids):
            return value
        raise _Wrong(f"a token id in [0, {2**31}) or a list of them")


@dataclass(frozen=True)
class Each:
    """A list (at most `longest` entries) whose every entry satisfies `rule`."""

    rule: Count | Number | Choice | Flag
    longest: int = 1 << 16
    nullable: bool = True

    def check(self, value) -> list:
        if isinstance(value, list) and len(value) <= self.longest:
            try:
                return [self.rule.check(v) for v in value]
            except _Wrong:
                pass
        raise _Wrong(f"a list of at most {self.longest} entries, each {_describe(self.rule)}")


@dataclass(frozen=True)
class Section:
    """A nested object (rope_parameters): its keys are checked by their own rows."""

    nullable: bool = True

    def check(self, value):
        if isinstance(value, Mapping):
            return value
        raise _Wrong("an object")


class _Wrong(Exception):
    """A rule's complaint: what the value should have been."""


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _describe(rule) -> str:
    try:
        rule.check(object())
    except _Wrong as wrong:
        return str(wrong)
    raise AssertionError(rule)


LAYERS = Count(1, 1024, nullable=False)
WIDTH = Count(1, 1 << 20, nullable=False)
POSITIONS = Count(1, 1 << 24)
FIELDS: dict[str, Count | Number | Flag | Choice | Ids | Each | Section] = {
    "vocab_size": Count(1, 1 << 22, nullable=False),
    "hidden_size": Count(1, 1 << 16, nullable=False),
    "intermediate_size": Count(0, 1 << 20, nullable=False),
    "moe_intermediate_size": WIDTH,
    "shared_expert_intermediate_size": Count(0, 1 << 20, nullable=False),
    "dense_intermediate": Count(0, 1 << 20),
    "num_hidden_layers": LAYERS,
    "num_attention_heads": Count(1, 1024, nullable=False),
    "num_key_value_heads": Count(1, 1024),
    "head_dim": Count(2, 4096),
    "num_experts": Count(1, 1 << 16),
    "num_local_experts": Count(1, 1 << 16),
    "n_routed_experts": Count(1, 1 << 16),
    "num_experts_per_tok": Count(1, 1024),
    "experts_per_token": Count(1, 1024),
    "n_shared_experts": Count(0, 1024),
    "n_group": Count(1, 1024),
    "topk_group": Count(1, 1024),
    "max_position_embeddings": POSITIONS,
    "original_max_position_embeddings": POSITIONS,
    "sliding_window": Count(0, 1 << 24),  # 0: no window
    "decoder_sparse_step": Count(0, 1024),
    "max_window_layers": Count(0, 1 << 20),
    "bos_token_id": Count(0, 2**31 - 1),
    "token_id": Count(0, 2**31 - 1),  # one of a GGUF file's tokenizer.ggml.*_token_id
    "eos_token_id": Ids(),
    "rms_norm_eps": Number(0, 1),
    "rope_theta": Number(0, 1e12),
    "factor": Number(0, 1e6),
    "beta_fast": Number(0, 1e6, low_open=False),
    "beta_slow": Number(0, 1e6, low_open=False),
    "attention_factor": Number(0, 1e6),
    "mscale": Number(0, 1e6, low_open=False),
    "mscale_all_dim": Number(0, 1e6, low_open=False),
    "routed_scaling_factor": Number(0, 1e6),
    "router_jitter_noise": Number(0, 1, low_open=False),
    "clip_qkv": Number(0, 1e6),
    "swiglu_limit": Number(0, 1e6, nullable=False),
    "swiglu_alpha": Number(0, 1e6, nullable=False),
    "norm_topk_prob": Flag(),
    "tie_word_embeddings": Flag(),
    "attention_bias": Flag(),
    "qkv_bias": Flag(),
    "use_sliding_window": Flag(),
    "truncate": Flag(),
    "hidden_act": Choice(tuple(HF_ACTIVATIONS)),
    "rope_type": Choice(("default", "linear", "yarn", "longrope")),
    "type": Choice(("default", "linear", "yarn", "longrope")),  # rope_scaling's older spelling of rope_type
    "short_factor": Each(Number(0, 1e6), longest=4096),  # longrope: one per frequency
    "long_factor": Each(Number(0, 1e6), longest=4096),
    "short_mscale": Number(0, 1e6),  # PhiMoE's longrope: the cos/sin scale up to / past the boundary
    "long_mscale": Number(0, 1e6),
    "topk_method": Choice(("greedy", "group_limited_greedy")),
    "layer_types": Each(Choice(("sliding_attention", "full_attention")), longest=1024),
    "mlp_only_layers": Each(Count(0, 1 << 20)),
    "moe_layers": Each(Flag(), longest=1024),
    "sliding_window_pattern": Count(1, 1024),  # GGUF: every n-th layer attends to all positions
    # MLA attention (DeepSeek-V2/V3) and GLM-4 MoE
    "q_lora_rank": Count(1, 1 << 16),  # null: q projected directly
    "kv_lora_rank": Count(1, 1 << 16),
    "qk_rope_head_dim": Count(2, 4096),
    "qk_nope_head_dim": Count(0, 4096),
    "v_head_dim": Count(1, 4096),
    "first_k_dense_replace": Count(0, 1024),
    "num_nextn_predict_layers": Count(0, 1024),  # GLM-4 MoE: multi-token-prediction layers after the rest
    "moe_layer_freq": Count(1, 1024),
    "partial_rotary_factor": Number(0, 1),
    "use_qk_norm": Flag(),
    "scoring_func": Choice(("softmax", "sigmoid")),
    "rope_interleave": Flag(),
    "rope_parameters": Section(),
    "rope_scaling": Section(),
    # PhiMoE
    "lm_head_bias": Flag(),
    # GraniteMoE's multipliers
    "embedding_multiplier": Number(0, 1e6),
    "residual_multiplier": Number(0, 1e6),
    "attention_multiplier": Number(0, 1e6),
    "logits_scaling": Number(0, 1e6),
}


class CheckedConfig(Mapping):
    """A config dict whose values are checked by their FIELDS row when read. `config[key]` is for a
    required key (missing: ConfigError); `config.get(key, default)` gives `default` for a key that
    is absent or null (a null where the row allows none is refused). Nested objects come back
    checked too. `names` maps a key to how the file spells it (GGUF metadata keys)."""

    def __init__(self, values: Mapping, names: Mapping[str, str] | None = None, prefix: str = ""):
        self._values, self._names, self._prefix = values, dict(names or {}), prefix

    def _spelled(self, key: str) -> str:
        return self._names.get(self._prefix + key, self._prefix + key)

    def _checked(self, key: str, value):
        rule = FIELDS.get(key)
        if value is None:
            if rule is not None and not rule.nullable:
                raise ConfigError(f"{self._spelled(key)} is null; it must be {_describe(rule)}.")
            return None
        if rule is None:
            return value
        try:
            value = rule.check(value)
        except _Wrong as wrong:
            raise ConfigError(f"{self._spelled(key)} is {quote(value)}; it must be {wrong}.") from None
        if isinstance(rule, Section):
            return CheckedConfig(value, self._names, f"{self._prefix}{key}.")
        return value

    def __getitem__(self, key: str):
        """A field the model needs: missing or null is refused, naming it (`get` is for the optional)."""
        if key not in self._values:
            raise ConfigError(f"{self._spelled(key)} is missing.")
        value = self._checked(key, self._values[key])
        if value is None:
            rule = FIELDS.get(key)
            raise ConfigError(
                f"{self._spelled(key)} is null; it must be {_describe(rule) if rule else 'set'}."
            )
        return value

    def get(self, key: str, default=None):
        value = self._checked(key, self._values.get(key))
        return default if value is None else value

    def __contains__(self, key) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def check_field(key: str, value, spelled: str | None = None):
    """One value checked by its FIELDS row (for readers that compute with it before a config is
    built: GGUF metadata); `spelled` is the key as the file has it."""
    return CheckedConfig({key: value}, {key: spelled or key})[key]
