"""moerun: Mixture-of-Experts language models, fast on one GPU and correct on a CPU."""

from moerun.layer import MoELayer, MoESpec, StateDictError
from moerun.routing import RouterError

__all__ = ["MoELayer", "MoESpec", "RouterError", "StateDictError"]
__version__ = "0.1.0"
