"""moerun: Mixture-of-Experts language models, fast on one GPU and correct on a CPU."""

from moerun.layer import MoELayer, MoESpec, StateDictError
from moerun.load import load
from moerun.model.transformer import MoEModel, Token
from moerun.routing import RouterError

__all__ = ["MoELayer", "MoEModel", "MoESpec", "RouterError", "StateDictError", "Token", "load"]
__version__ = "0.1.0"
