"""Predicts attention traffic and time of context-parallel methods and picks a mesh shape."""
from megatron_mesh.planner.cost import Estimate, NotApplicable, PricedTransfer, Unavailable
from megatron_mesh.planner.gpu_profile import GPU_PROFILES, GpuProfile, load_profile
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.ranks_on_nodes import Placement, mesh_placement
from megatron_mesh.planner.search import Plan, plan, search

__all__ = [
    "Cluster",
    "Estimate",
    "GPU_PROFILES",
    "GpuProfile",
    "NotApplicable",
    "Placement",
    "Plan",
    "PricedTransfer",
    "Unavailable",
    "Workload",
    "load_profile",
    "mesh_placement",
    "plan",
    "search",
]
