"""The driver's mask flags end to end on CPU, against the same flags at CP = 1:
--attention-chunk-size 12 with --no-rope-freq 2 (Llama 4: layer 1 chunked with RoPE, layer 2
global without) on a 2x2 mesh and a 2x1x2 grid, its attention bytes against the dense
exchange's (layer 1 moves a few rows: a chunk spans at most two sub-chunks of 8 tokens);
a prefix-LM mask from --mesh-mask-builder on 2x2; both over packed documents
(--reset-attention-mask: chunks restart at each document, the builder's mask within each
document), placed (balanced) and in Transformer Engine's THD layout, on 2x2 and 2x1x2; a
builder that returns no mask stops every rank with one line, exit 2, and so does one that
raises on one data-parallel replica's ranks only (the others would wait for it)."""
from __future__ import annotations

from pathlib import Path

import pytest
from preloaded import Job, Run, driver_data_args, job_env, launch

ITERS = 3
CHUNKED = ["--attention-chunk-size", "12", "--no-rope-freq", "2"]
PREFIX = ["--mesh-mask-builder", "examples.mask_builders:prefix_lm"]
MESH = ["--context-parallel-algo", "mesh"]
CP4 = [*MESH, "--context-parallel-size", "4", "--mesh-shape"]
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids"]
TE = ["--mesh-document-placement", "te"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    data = driver_data_args(tmp_path_factory.mktemp("masks"), ITERS)
    return {
        "cp1 chunked": launch(1, [*data, *MESH, *CHUNKED]),
        "2x2 chunked": launch(4, [*data, *CHUNKED, *CP4, "2x2"]),
        "2x1x2 chunked": launch(4, [*data, *CHUNKED, *CP4, "2x1x2"]),
        "2x2 nope": launch(4, [*data, "--no-rope-freq", "2", *CP4, "2x2"]),
        "cp1 prefix": launch(1, [*data, *MESH, *PREFIX]),
        "2x2 prefix": launch(4, [*data, *PREFIX, *CP4, "2x2"]),
    }


@pytest.fixture(scope="module")
def document_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    data = [*driver_data_args(tmp_path_factory.mktemp("docs"), ITERS, (5, 40), seed=1),
            *DOCUMENTS]
    return {
        "cp1": launch(1, [*data, *MESH]),
        "cp1 chunked": launch(1, [*data, *MESH, *CHUNKED]),
        "2x2 chunked": launch(4, [*data, *CHUNKED, *CP4, "2x2"]),  # placed (balanced)
        "2x1x2 chunked": launch(4, [*data, *CHUNKED, *CP4, "2x1x2", *TE]),
        "cp1 prefix": launch(1, [*data, *MESH, *PREFIX]),
        "2x2 prefix": launch(4, [*data, *PREFIX, *CP4, "2x2", *TE]),
        "2x1x2 prefix": launch(4, [*data, *PREFIX, *CP4, "2x1x2"]),
    }


def _same(run: Run, ref: Run) -> None:
    run.assert_trains_like(ref, range(1, ITERS + 1))


@pytest.mark.parametrize("grid", ["2x2", "2x1x2"])
def test_chunked_attention_matches_cp1(runs: dict[str, Run], grid: str) -> None:
    _same(runs[f"{grid} chunked"], runs["cp1 chunked"])


def test_chunks_change_the_model_and_move_few_bytes(runs: dict[str, Run]) -> None:
    """Without chunks (the same NoPE layers) the losses differ; with them layer 1 takes the
    sparse exchange and moves a fraction of what the dense layer 2 moves."""
    chunked, dense = runs["2x2 chunked"], runs["2x2 nope"]
    assert dense.returncode == 0, dense.output[-3000:]
    assert chunked.losses() != pytest.approx(dense.losses(), rel=1e-4)
    got, base = (list(map(float, r.traffic())) for r in (chunked, dense))
    assert len(got) == len(base) == ITERS
    for c, d in zip(got, base):  # d: two dense layers; c: one dense layer and the chunked one
        assert 0 < c - d / 2 < 0.25 * d / 2, (got, base)


def test_prefix_lm_builder_matches_cp1(runs: dict[str, Run]) -> None:
    _same(runs["2x2 prefix"], runs["cp1 prefix"])
    assert runs["2x2 prefix"].losses() != pytest.approx(runs["2x2 nope"].losses(), rel=1e-4)


@pytest.mark.parametrize("name", ["2x2 chunked", "2x1x2 chunked", "2x2 prefix",
                                  "2x1x2 prefix"])
def test_masks_over_packed_documents_match_cp1(document_runs: dict[str, Run],
                                               name: str) -> None:
    """Chunks restarting at each document, and the builder's prefix-LM mask within each
    document, over placed and THD documents, equal CP = 1; both change the model."""
    ref = document_runs["cp1 " + name.split()[1]]
    _same(document_runs[name], ref)
    assert document_runs["cp1"].returncode == 0, document_runs["cp1"].output[-3000:]
    assert ref.losses() != pytest.approx(document_runs["cp1"].losses(), rel=1e-4)


def test_a_builder_returning_no_mask_stops_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "bad_builder.py"
    path.write_text("def build(tokens, position_ids):\n    return tokens.shape[-1]\n")
    data = driver_data_args(tmp_path, ITERS)
    job = Job([*data, "--mesh-mask-builder", f"{path}:build", *MESH,
               "--context-parallel-size", "2"], job_env(), nproc=2, stop_others=False)
    run = job.wait(timeout=200)
    assert job.exitcodes == [2, 2], run.output[-2000:]
    line = f"pretrain_gpt: error: --mesh-mask-builder {path}:build returned 64; it must return"
    assert run.output.count(line) == 1, run.output[-2000:]


def test_a_builder_failing_on_one_replica_stops_every_rank(tmp_path: Path) -> None:
    """CP 2 x DP 2: the builder raises on the two ranks of data-parallel replica 1 only;
    every rank exits 2 (none waits for the failed replica), the error printed once with
    the rank it happened on."""
    path = tmp_path / "replica_builder.py"
    path.write_text("from megatron.core import parallel_state\n\n\n"
                    "def build(tokens, position_ids):\n"
                    "    if parallel_state.get_data_parallel_rank() == 1:\n"
                    "        raise RuntimeError('no image in this sample')\n"
                    "    n = tokens.shape[-1]\n"
                    "    return [(0, n, 0, n, 'causal')]\n")
    data = driver_data_args(tmp_path, ITERS)
    job = Job([*data, "--mesh-mask-builder", f"{path}:build", *MESH,
               "--context-parallel-size", "2"], job_env(), nproc=4, stop_others=False)
    run = job.wait(timeout=200)
    assert job.exitcodes == [2, 2, 2, 2], run.output[-2000:]
    line = (f"pretrain_gpt: error: --mesh-mask-builder {path}:build raised RuntimeError: no "
            "image in this sample (for a micro-batch of (2, 64) tokens) (on rank 2)")
    errors = [x for x in run.output.splitlines() if "error:" in x]
    assert errors == [line], run.output[-2000:]
