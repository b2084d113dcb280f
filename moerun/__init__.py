"""moerun: Mixture-of-Experts language models, fast on one GPU and correct on a CPU."""

from moerun.batching import Grammar, GrammarError, Token
from moerun.checkpoint.load import load
from moerun.errors import CheckpointError, ConfigError, GGUFMetadataError, TensorError, TokenizerError
from moerun.model import MoEModel
from moerun.moe.layer import MoELayer, MoESpec, StateDictError
from moerun.moe.routing import RouterError

__all__ = [
    "CheckpointError",
    "ConfigError",
    "GGUFMetadataError",
    "Grammar",
    "GrammarError",
    "MoELayer",
    "MoEModel",
    "MoESpec",
    "RouterError",
    "StateDictError",
    "TensorError",
    "Token",
    "TokenizerError",
    "load",
]
__version__ = "0.1.0"
