"""An emulated cluster on one machine: shaped links at the collectives, compute by the clock.

`Emulation` names the modelled cluster (a planner `Cluster`: GPUs per node, link rates,
attention TFLOP/s or a GPU profile of kernel calls) and how many times slower this machine
plays it. `ShapedLinks` holds every collective of `megatron_mesh.runtime.comm` until the
emulated links would have carried its bytes (the real bytes still move, over real gloo);
`EmulatedKernel` is a tile kernel that returns tensors of the right shapes after sleeping
for the planner's compute time of the tile (`Emulation.kernel()` builds the one that plays
the modelled cluster's).
Timings taken this way are emulated and say so wherever they are printed.
"""
from megatron_mesh.emulation.cluster import Emulation
from megatron_mesh.emulation.compute import EmulatedKernel
from megatron_mesh.emulation.links import ShapedLinks

__all__ = ["Emulation", "EmulatedKernel", "ShapedLinks"]
