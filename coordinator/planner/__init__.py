"""The planner (DESIGN §4), pure and importable without the coordinator service:

profile.py    per-layer FLOPs, bytes, memory and times (meter.py measures on the meta device)
shapes.py     what flows between the layers, from a shape-only pass
cache.py      what those found, kept across runs
memory.py     what a range of layers needs on its GPU at a given Nm
allocation.py which GPUs form each virtual worker (NP, ED, HD)
partition.py  the exact order and cut of one virtual worker (kinds.py: its tables and bounds)
placement.py  which shard owns each parameter
simulator.py  a discrete-event simulation of the pipelines under WSP
costs.py      what each stage's tasks and transfers take, and the simulated prediction
plan.py       make_plan: all of the above, best plan first
"""

from coordinator.planner.cluster import Gpu, PlanError, cluster_gpus
from coordinator.planner.cache import default_cache_dir
from coordinator.planner.plan import Plan, StagePlan, make_plan, resolved_job

__all__ = ["Gpu", "Plan", "PlanError", "StagePlan", "cluster_gpus", "default_cache_dir", "make_plan", "resolved_job"]
