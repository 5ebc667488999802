"""The driver flags that run the planner's choice (`python -m megatron_mesh.pretrain_gpt` or a
patched Megatron-LM), and tensor parallelism as the planner sees it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_mesh.layer_plan import (
    DEFAULT_GRAD_DTYPE,
    DEFAULT_SCHEDULE,
    DTYPE_BYTES,
    AttentionShape,
    GridShape,
)

PLACEMENT_FLAG = "--mesh-document-placement balanced"  # the layout the placement is priced in


def driver_flags(cp_size: int, grid: tuple[int, int, int], tensor_parallel: int = 1,
                 schedule: str = DEFAULT_SCHEDULE,
                 grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE, placed_documents: bool = False,
                 window: tuple[int, int] | None = None,
                 window_attn_skip_freq: int | None = None) -> list[str]:
    """The flags of a run on the heads x rows x cols `grid` over `cp_size` CP ranks:
    --mesh-schedule and --mesh-grad-reduce-dtype only where they are not the default, and
    --tensor-model-parallel-size only above 1; the mask the plan priced: packed documents
    placed whole (`placed_documents`: --reset-attention-mask, the driver's documents, with
    --mesh-document-placement balanced), a sliding `window` (left, right; inside each
    document with documents) and the layers it skips (--window-size,
    --window-attn-skip-freq)."""
    shape = GridShape(*grid).check_cp_size(cp_size)
    flags = [] if tensor_parallel == 1 else ["--tensor-model-parallel-size", str(tensor_parallel)]
    flags += ["--context-parallel-size", str(cp_size), "--cp-comm-type", "mesh",
              "--mesh-shape", shape.text]
    if schedule != DEFAULT_SCHEDULE:
        flags += ["--mesh-schedule", schedule]
    if grad_reduce_dtype != DEFAULT_GRAD_DTYPE:
        flags += ["--mesh-grad-reduce-dtype", grad_reduce_dtype]
    if placed_documents:
        flags += ["--reset-attention-mask", *PLACEMENT_FLAG.split()]
    if window is not None:
        flags += ["--window-size", *map(str, window)]
        if window_attn_skip_freq is not None:
            flags += ["--window-attn-skip-freq", str(window_attn_skip_freq)]
    return flags


@dataclass(frozen=True)
class TensorParallel:
    """TP ranks of one sequence's GPUs, consecutive as Megatron orders them (TP first, then
    CP): each holds 1 / TP of the heads, and a node of `gpus_per_node` GPUs holds
    gpus_per_node / TP CP ranks. `gpus` = TP x CP."""

    size: int
    gpus: int
    gpus_per_node: int
    num_heads: int
    num_kv_heads: int

    def problems(self) -> list[str]:
        """What does not divide, each naming the values (empty when all do)."""
        tp = f"--tensor-model-parallel-size {self.size}"
        valid = ", ".join(map(str, self.valid_sizes()))
        out = [f"{tp} does not divide --{flag} {value}; valid sizes here: {valid}"
               for flag, value in (("num-heads", self.num_heads),
                                   ("num-kv-heads", self.num_kv_heads),
                                   ("gpus-per-node", self.gpus_per_node), ("gpus", self.gpus))
               if value % self.size]
        if not out and self.gpus // self.size < 2:
            out.append(f"--gpus {self.gpus} / {tp} leaves a context-parallel size of "
                       f"{self.gpus // self.size}; give --gpus >= {2 * self.size} or a TP "
                       f"of {valid}")
        return out

    def valid_sizes(self) -> list[int]:
        """Every TP that divides the heads, the GPUs per node and the GPUs and leaves a CP
        size >= 2."""
        common = math.gcd(self.num_heads, self.num_kv_heads, self.gpus_per_node, self.gpus)
        return [t for t in range(1, common + 1) if common % t == 0 and self.gpus // t >= 2]

    @property
    def cp_size(self) -> int:
        return self.gpus // self.size

    @property
    def cp_per_node(self) -> int:
        return self.gpus_per_node // self.size

    @property
    def heads(self) -> tuple[int, int]:
        """(query, K/V) heads of one TP rank."""
        return self.num_heads // self.size, self.num_kv_heads // self.size

    def attention_shape(self, seq_length: int, batch: int, head_dim: int, dtype: str
                        ) -> AttentionShape:
        """The layer as one TP rank's attention sees it: its heads, the whole sequence."""
        return AttentionShape(seq_length, batch, *self.heads, head_dim, DTYPE_BYTES[dtype])

    def describe(self) -> str:
        """One line for people."""
        q, kv = self.heads
        return (f"tensor parallelism {self.size}: each TP rank holds {q} q / {kv} kv heads; "
                f"context parallelism over {self.gpus} GPUs / TP {self.size} = {self.cp_size} "
                f"CP ranks, {self.cp_per_node} per node ({self.gpus_per_node} GPUs per node / "
                f"TP {self.size})")
