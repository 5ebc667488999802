"""--reset-attention-mask in the driver: documents really masked, at CP = 1 and with the mesh.

A dataset of real EOD-separated documents is built with megatron-core's indexed dataset
builder (each document ends in the NullTokenizer's EOD id, --vocab-size). With
--reset-attention-mask --reset-position-ids, CP = 1's losses differ from its losses without
the flags (the mask does something), and the mesh in Transformer Engine's THD layout
(--mesh-document-placement te: 2x2, 1x4, 2x1x2; 2x1 under two pipeline stages) and two
pipeline stages at CP = 1 match CP = 1 with documents masked (the pipeline runs from
CP = 1's checkpoint, each stage loading its layers). That a packed document's loss and gradients
equal those of the document run alone is checked on the model in tests/distributed/test_megatron_parity.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from preloaded import Run, driver_data_args, launch

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
ITERS = 6
VOCAB = 255  # tiny-cpu.yaml's --vocab-size: the NullTokenizer's EOD id
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids"]
SAVE_AT = 3  # the pipeline runs (two stages of one layer, two micro-batches per iteration:
# 1F1B sends activations of packed micro-batches whose token counts differ) resume here


@pytest.fixture(scope="module")
def data_args(work: Path) -> list[str]:
    return driver_data_args(work, ITERS, (5, 40), seed=1)


@pytest.fixture(scope="module")
def runs(data_args: list[str], work: Path) -> dict[str, Run]:
    # Transformer Engine's THD layout here; the default balanced placement: test_placed_training
    te = ["--mesh-document-placement", "te"]
    mesh = [*te, "--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape"]
    ckpt = str(work / "cp1-ckpt")
    # a pipeline run initializes its stages differently from one stage (as Megatron-LM
    # does): the pipeline runs start from CP = 1's checkpoint of iteration SAVE_AT
    resume = ["--pipeline-model-parallel-size", "2", "--load", ckpt, "--ckpt-step",
              str(SAVE_AT)]
    cp1 = launch(1, [*data_args, *DOCUMENTS, "--save", ckpt, "--save-interval", str(SAVE_AT)])
    return {
        "cp1": launch(1, data_args),
        "cp1 documents": cp1,
        "2x2 documents": launch(4, [*data_args, *DOCUMENTS, *mesh, "2x2"]),
        "1x4 documents": launch(4, [*data_args, *DOCUMENTS, *mesh, "1x4"]),
        "2x1x2 documents": launch(4, [*data_args, *DOCUMENTS, *mesh, "2x1x2"]),
        "pp2 2x1 documents": launch(4, [*data_args, *DOCUMENTS, *resume, *te,
                                        "--context-parallel-size", "2",
                                        "--context-parallel-algo", "mesh", "--mesh-shape",
                                        "2x1"]),
        "pp2 cp1 documents": launch(2, [*data_args, *DOCUMENTS, *resume]),
    }


def test_document_mask_changes_cp1_losses(runs: dict[str, Run]) -> None:
    for name in ("cp1", "cp1 documents"):
        assert runs[name].returncode == 0, runs[name].output[-3000:]
    plain, masked = runs["cp1"].losses(), runs["cp1 documents"].losses()
    assert sorted(plain) == sorted(masked) == list(range(1, ITERS + 1))
    # the first iteration already sees other attention (same weights, same data)
    assert all(abs(plain[it] - masked[it]) > 1e-4 for it in plain), (plain, masked)


@pytest.mark.parametrize("grid", ["2x2", "1x4", "2x1x2", "pp2 2x1", "pp2 cp1"])
def test_mesh_with_documents_matches_cp1(runs: dict[str, Run], grid: str) -> None:
    run = runs[f"{grid} documents"]
    assert run.returncode == 0, run.output[-3000:]
    ref, mesh = runs["cp1 documents"].losses(), run.losses()
    first = SAVE_AT + 1 if grid.startswith("pp2") else 1
    assert sorted(mesh) == list(range(first, ITERS + 1))
    for it in mesh:
        assert mesh[it] == pytest.approx(ref[it], rel=2e-5), (it, ref, mesh)
