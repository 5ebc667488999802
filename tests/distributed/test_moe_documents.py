"""A mixture of experts on packed documents (--reset-attention-mask) through the driver.

The packing pads: the te placement every document, the balanced one the total (to a
multiple of 2 CP, x TP under sequence parallelism), so CP, TP and the placement each add
their own padding tokens. megatron-core's routers leave the tokens its `padding_mask`
names out of the load-balancing loss; with it the lm and load-balancing losses equal CP =
1's on every placement and grid: te on 2x2 and 4x1 (also with global_aux_loss, whose
expert counts are averaged over the micro-batches and reduced over DP), balanced on 2x2
(which needs no padding there), and balanced under TP 2 x sequence parallelism x CP 2 on micro-batches of
one 132-token sample, padded to 136 (a multiple of 2 CP x TP = 8). The loss coefficient 1.0
makes the load-balancing gradients move the later iterations' losses.

--mesh-balance-data-parallel regroups the documents over the micro-batches, which changes
a loss computed per micro-batch: with the load-balancing loss it exits 2; with top-k
routing and no loss (each token routed by its own logits) DP 2 x CP 2 gives the losses of
the batch as read.

Under pipeline stages (megatron-core's alltoall dispatcher: a GPU's) with sequence
parallelism a later stage gets the TP share of the mask that megatron-core gives the first
stage's layers; checked on TP 2 x PP 2 gloo ranks.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from preloaded import Run, driver, driver_data_args, launch

ITERS = 3
SEQ_132 = ["--seq-length", "132", "--max-position-embeddings", "132", "--micro-batch-size", "1"]
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--init-method-std", "0.2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1.0"]
MESH = ["--context-parallel-algo", "mesh", "--mesh-shape"]
CP4 = ["--context-parallel-size", "4", *MESH]
TE = ["--mesh-document-placement", "te"]
GLOBAL = ["--moe-router-load-balancing-type", "global_aux_loss"]
REFERENCES = {"cp1": [], "cp1 seq 132": SEQ_132, "cp1 global": GLOBAL}
GRIDS = {  # name: ranks, flags, the CP = 1 reference
    "2x2 te": (4, [*CP4, "2x2", *TE], "cp1"),
    "4x1 te": (4, [*CP4, "4x1", *TE], "cp1"),
    "2x2 balanced": (4, [*CP4, "2x2"], "cp1"),
    "2x2 te global_aux_loss": (4, [*CP4, "2x2", *TE, *GLOBAL], "cp1 global"),
    "tp2 sp 2x1 balanced seq 132": (4, [*SEQ_132, "--tensor-model-parallel-size", "2",
                                        "--sequence-parallel", "--context-parallel-size", "2",
                                        *MESH, "2x1"], "cp1 seq 132"),
}


@pytest.fixture(scope="module")
def data_args(work: Path) -> list[str]:
    return [*driver_data_args(work, ITERS, (5, 40), seed=1), *DOCUMENTS]


@pytest.fixture(scope="module")
def runs(data_args: list[str]) -> dict[str, Run]:
    out = {name: launch(1, [*data_args, *MOE, *flags]) for name, flags in REFERENCES.items()}
    for name, (ranks, flags, _) in GRIDS.items():
        out[name] = launch(ranks, [*data_args, *MOE, *flags])
    return out


@pytest.mark.parametrize("name", list(GRIDS))
def test_moe_losses_on_padded_documents_match_cp1(runs: dict[str, Run], name: str) -> None:
    run, ref = runs[name], runs[GRIDS[name][2]]
    for r in (run, ref):
        assert r.returncode == 0, r.output[-3000:]
    got, want = run.lines(), ref.lines()
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    aux = [k for k in want[1] if k.endswith("load_balancing_loss")]
    assert len(aux) == 1, want[1]
    for it in want:
        for field in ("lm loss", *aux):
            assert float(got[it][field]) == pytest.approx(float(want[it][field]), rel=1e-5), (
                it, field, got[it], want[it])


def test_dp_balance_with_the_load_balancing_loss_exits_2(data_args: list[str]) -> None:
    run = driver([*data_args, *MOE, "--calculate-per-token-loss", "--mesh-balance-data-parallel"])
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if "error:" in line]
    assert len(errors) == 1, run.output[-3000:]
    assert ("--mesh-balance-data-parallel with --num-experts: megatron-core computes the "
            "load-balancing loss (aux_loss, --moe-aux-loss-coeff 1)") in errors[0]
    assert "Traceback" not in run.output


def test_dp_balance_of_top_k_routing_without_a_loss_keeps_the_losses(
        data_args: list[str]) -> None:
    dp2_cp2 = [*data_args, "--num-experts", "4", "--calculate-per-token-loss",
               "--global-batch-size", "8", "--context-parallel-size", "2", *MESH, "2x1"]
    balanced, as_read = launch(4, dp2_cp2), launch(4, [*dp2_cp2, "--no-mesh-balance-data-parallel"])
    for r in (balanced, as_read):
        assert r.returncode == 0, r.output[-3000:]
    assert "DP x CP balance of the global batch on" in balanced.output
    got, want = balanced.losses(), as_read.losses()
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5), (it, got, want)


def _stage_masks(rank: int, world: int) -> tuple[bool, list[bool], list[bool]]:
    """On TP 2 x PP 2 with sequence parallelism: (first stage?, the mask this stage's
    GPTModel gets from router_padding_mask, the TP share megatron-core's own split gives)."""
    from types import SimpleNamespace

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    from megatron_mesh.training.model.moe import router_padding_mask

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 2, create_gloo_process_groups=False)
    mask = torch.rand(1, 12, generator=torch.Generator().manual_seed(3)) > 0.5
    model = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(sequence_parallel=True)))
    given = router_padding_mask({"padding_mask": mask}, model)["padding_mask"]
    share = scatter_to_sequence_parallel_region(mask.transpose(0, 1).contiguous()).transpose(0, 1)
    return ps.is_pipeline_first_stage(), given.flatten().tolist(), share.flatten().tolist()


def test_a_later_pipeline_stage_gets_its_tp_share_of_the_padding_mask() -> None:
    """GPTModel splits the mask over TP under sequence parallelism on the first stage only
    (megatron-core 0.16 to 0.19): there it gets the whole mask, on a later stage its TP
    share, as megatron-core's split gives the first stage's layers."""
    from dist_utils import run_distributed

    results = run_distributed(_stage_masks, 4)
    assert sorted(first for first, _, _ in results) == [False, False, True, True]
    for first, given, share in results:
        assert len(share) == 6
        assert (len(given) == 12) if first else (given == share), (first, given, share)
    assert len({tuple(s) for _, _, s in results}) == 2  # the two TP ranks' halves
