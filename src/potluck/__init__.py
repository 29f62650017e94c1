"""potluck: plan, predict and run hybrid-parallel transformer training on mixed GPUs.

The Python API mirrors the CLI: ``potluck.plan(cluster, model, ...)`` returns the
best plans for a cluster file (or :class:`ClusterSpec`) and a model preset,
``config.json`` or Hugging Face directory; ``potluck.cost(model, tokens, ...)``
ranks the clusters one could rent or buy by USD per million tokens.
"""

from potluck.api import cost, plan
from potluck.cluster import ClusterSpec, load_cluster
from potluck.errors import ConfigError, InfeasibleError, PotluckError
from potluck.model import ModelSpec, load_model
from potluck.plans import Plan, load_plan, save_plan
from potluck.version import __version__ as __version__

__all__ = [
    "ClusterSpec", "ConfigError", "InfeasibleError", "ModelSpec", "Plan", "PotluckError",
    "cost", "load_cluster", "load_model", "load_plan", "plan", "save_plan",
]
