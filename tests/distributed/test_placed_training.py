"""--mesh-document-placement balanced in the driver: documents placed over the CP ranks.

The reference is CP = 1 with documents masked (--reset-attention-mask, one packed
sequence per micro-batch in order). With the balanced placement (the default with the
mesh) every micro-batch's documents are placed by `place_documents` and tokens, labels,
loss mask and positions permuted by its `token_indices`; the loss and grad norm equal the
reference on the 2x2, 1x4 and 2x1x2 grids, under two pipeline stages (2x1) and under
TP 2 x sequence parallelism (2x1), with a sliding window (2x2 against CP = 1 with the
same window) and with multi-latent attention (2x1x2, where megatron-core builds it).
--init-method-std 0.2 makes RoPE matter: rotating the placed rows at wrong positions
(every row at position 0) moves the first loss by 2% here, far outside the tolerance.
On these EOD-separated documents the logged attention bytes of the balanced placement are
below those of --mesh-document-placement te (Transformer Engine's layout, every document
cut over all ranks), and the two log which one runs.

DP 2 x CP 2 with --calculate-per-token-loss: --mesh-balance-data-parallel (on by default
there) regroups each global batch's documents over the replicas' micro-batches by their
attention work; the losses and grad norms equal those of --no-mesh-balance-data-parallel
(the batches as read), and the logged work of the busiest replica falls.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from preloaded import Run, driver, driver_data_args, launch

from megatron_mesh import cli

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
ITERS = 5
SAVE_AT = 2  # the pipeline run starts from CP = 1's checkpoint of this iteration
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--init-method-std", "0.2"]
MESH = ["--context-parallel-algo", "mesh", "--mesh-shape"]
BALANCED = "placement balanced (place_documents"
WINDOW = ["--window-size", "12", "0"]  # a sliding window inside each document


@pytest.fixture(scope="module")
def data_args(work: Path) -> list[str]:
    return [*driver_data_args(work, ITERS, (5, 40), seed=1), *DOCUMENTS]


PLAN = ["plan", "--gpus", "4", "--gpus-per-node", "4", "--seq-length", "128",
        "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads", "2", "--dtype", "fp32",
        "--doc-length-dist", "lognormal:16:40:1"]  # tiny-cpu.yaml's micro-batch, packed


@pytest.fixture(scope="module")
def planner_flags() -> list[str]:
    """The line `megatron-mesh plan` prints under 'driver flags of the choice' for the tiny
    model's packed micro-batches, as a user pastes it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(PLAN) == 0
    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("driver flags of the choice"))
    return shlex.split(lines[at + 1])


@pytest.fixture(scope="module")
def runs(data_args: list[str], work: Path, planner_flags: list[str]) -> dict[str, Run]:
    ckpt = str(work / "cp1-ckpt")
    resume = ["--pipeline-model-parallel-size", "2", "--load", ckpt, "--ckpt-step",
              str(SAVE_AT)]
    cp2 = ["--context-parallel-size", "2", *MESH, "2x1"]
    cp4 = ["--context-parallel-size", "4"]
    return {
        "cp1": launch(1, [*data_args, "--save", ckpt, "--save-interval", str(SAVE_AT)]),
        "2x2": launch(4, [*data_args, *cp4, *MESH, "2x2"]),
        "2x2 te": launch(4, [*data_args, *cp4, *MESH, "2x2", "--mesh-document-placement",
                             "te"]),
        "1x4": launch(4, [*data_args, *cp4, *MESH, "1x4"]),
        "2x1x2": launch(4, [*data_args, *cp4, *MESH, "2x1x2"]),
        "pp2 2x1": launch(4, [*data_args, *resume, *cp2]),
        "tp2 sp 2x1": launch(4, [*data_args, "--tensor-model-parallel-size", "2",
                                 "--sequence-parallel", *cp2]),
        "cp1 window": launch(1, [*data_args, *WINDOW]),
        "2x2 window": launch(4, [*data_args, *WINDOW, *cp4, *MESH, "2x2"]),
        # the planner's line with the documents' data but without DOCUMENTS' mask flag
        "planner": launch(4, [*[a for a in data_args if a != "--reset-attention-mask"],
                              *planner_flags]),
    }


@pytest.mark.parametrize("name", ["2x2", "1x4", "2x1x2", "pp2 2x1", "tp2 sp 2x1",
                                  "2x2 window"])
def test_balanced_placement_matches_cp1(runs: dict[str, Run], name: str) -> None:
    run, ref = runs[name], runs["cp1 window" if "window" in name else "cp1"]
    for r in (run, ref):
        assert r.returncode == 0, r.output[-3000:]
    assert BALANCED in run.output
    first = SAVE_AT + 1 if name.startswith("pp2") else 1
    run.assert_trains_like(ref, range(first, ITERS + 1), ref_iterations=range(1, ITERS + 1))


def test_planner_flags_train_documents_as_priced(runs: dict[str, Run],
                                                 planner_flags: list[str]) -> None:
    """The planner's printed flags for packed documents, pasted as they are, train the
    documents masked and placed as it priced them: CP = 1's documents-masked losses."""
    assert "--reset-attention-mask" in planner_flags, planner_flags
    at = planner_flags.index("--mesh-document-placement")
    assert planner_flags[at + 1] == "balanced", planner_flags
    run, ref = runs["planner"], runs["cp1"]
    assert run.returncode == 0, run.output[-3000:]
    assert BALANCED in run.output
    got, want = run.losses(), ref.losses()
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it, loss in got.items():
        assert loss == pytest.approx(want[it], rel=2e-5), (it, got, want)


def test_window_changes_cp1_losses(runs: dict[str, Run]) -> None:
    plain, window = runs["cp1"].losses(), runs["cp1 window"].losses()
    assert sorted(plain) == sorted(window) == list(range(1, ITERS + 1))
    assert all(abs(plain[it] - window[it]) > 1e-4 for it in plain), (plain, window)


def test_balanced_placement_moves_fewer_bytes_than_te(runs: dict[str, Run]) -> None:
    balanced, te = runs["2x2"], runs["2x2 te"]
    for r in (balanced, te):
        assert r.returncode == 0, r.output[-3000:]
    assert "placement te (Transformer Engine's THD layout" in te.output
    assert balanced.losses() == pytest.approx(te.losses(), rel=2e-5)
    got, base = (list(map(float, r.traffic())) for r in (balanced, te))
    assert len(got) == len(base) == ITERS
    for b, t in zip(got, base):
        assert 0 < b < t, (got, base)


@pytest.mark.parametrize("flags, named", [
    (["--mesh-document-placement", "zigzag"], "'zigzag'"),
    (["--mesh-document-placement", "te", "--mesh-balance-data-parallel",
      "--calculate-per-token-loss"], "--mesh-document-placement balanced"),
    (["--mesh-balance-data-parallel"], "--calculate-per-token-loss"),
    # the placement alone (the planner's line before it named --reset-attention-mask)
    (["--no-reset-attention-mask", "--mesh-document-placement", "balanced"],
     "--mesh-document-placement balanced needs --reset-attention-mask"),
])
def test_bad_placement_flags_exit_2(data_args: list[str], flags: list[str], named: str) -> None:
    run = driver([*data_args, *flags])
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0], run.output[-3000:]


@pytest.fixture(scope="module")
def dp_runs(data_args: list[str]) -> dict[str, Run]:
    dp2_cp2 = [*data_args, "--calculate-per-token-loss", "--global-batch-size", "8",
               "--context-parallel-size", "2", *MESH, "2x1"]
    return {"balanced": launch(4, dp2_cp2),
            "as read": launch(4, [*dp2_cp2, "--no-mesh-balance-data-parallel"])}


def test_dp_balance_keeps_per_token_loss_and_grads(dp_runs: dict[str, Run]) -> None:
    balanced, as_read = dp_runs["balanced"], dp_runs["as read"]
    for r in (balanced, as_read):
        assert r.returncode == 0, r.output[-3000:]
        assert "x DP 2 |" in r.output and "2 micro-batches" in r.output, r.output[-3000:]
    assert "DP x CP balance of the global batch on" in balanced.output
    assert "DP x CP balance of the global batch off" in as_read.output
    balanced.assert_trains_like(as_read, range(1, ITERS + 1))
    ratios = re.search(r"busiest DP replica / mean ([0-9.]+) as read, ([0-9.]+) with "
                       r"documents regrouped", balanced.output)
    assert ratios, balanced.output[-3000:]
    assert float(ratios[2]) < float(ratios[1]), ratios[0]


MLA = ["--multi-latent-attention", "--no-group-query-attention", "--num-query-groups", "4",
       "--q-lora-rank", "32", "--kv-lora-rank", "32", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]


def test_balanced_placement_with_mla_matches_cp1(data_args: list[str]) -> None:
    """Multi-latent attention (its own RoPE call, MLA-interleaved, on the RoPE part of the
    head dim) over placed documents on 2x1x2; megatron-core >= 0.17 builds MLA without TE."""
    from megatron_mesh.megatron.compat import mla_unbuildable_reason

    if mla_unbuildable_reason() is not None:
        pytest.skip(f"needs a GPU (Transformer Engine needs CUDA): {mla_unbuildable_reason()}; "
                    "scripts/test_mcore019.sh runs it on megatron-core 0.19")
    ref = launch(1, [*data_args, *MLA])
    run = launch(4, [*data_args, *MLA, "--context-parallel-size", "4", *MESH, "2x1x2"])
    for r in (ref, run):
        assert r.returncode == 0, r.output[-3000:]
    assert BALANCED in run.output
    run.assert_trains_like(ref, range(1, ITERS + 1))
