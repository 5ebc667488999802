"""A mixture of experts with packed documents, on plain values: the packers' padding mask
(training/data/document_ranks.py) that megatron-core's routers take, the flags that refuse or turn
off --mesh-balance-data-parallel with a load-balancing loss, and TP without sequence
parallelism refused before any process group."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_mesh.training.config.arguments import ConfigError, parse_args
from megatron_mesh.training.data.document_ranks import BALANCED, TE, DocumentPacker

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
DP2_CP2 = ["--config", TINY, "--mock-data", "--reset-attention-mask", "--calculate-per-token-loss",
           "--global-batch-size", "8", "--context-parallel-size", "2",
           "--context-parallel-algo", "mesh"]


@pytest.fixture(autouse=True)
def _world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")


@pytest.mark.parametrize("placement, cp, multiple", [
    (TE, 2, 1), (TE, 4, 1), (BALANCED, 2, 1), (BALANCED, 4, 1), (BALANCED, 2, 2), (TE, 1, 2)])
def test_padding_mask_marks_exactly_the_packings_padding(placement: str, cp: int,
                                                          multiple: int) -> None:
    """Tokens 1 .. n (no 0) packed on every CP rank: the padding mask is True exactly where
    the packing put a padding token (token 0), and the ranks together hold every token."""
    lengths = [5, 11, 2, 9, 7]  # 34 tokens: te pads each, balanced the total
    tokens = torch.arange(1, sum(lengths) + 1)
    seen = []
    for rank in range(cp):
        packer = DocumentPacker(placement, cp, rank, multiple, None, padding_mask=True)
        for out in (packer({"tokens": tokens.view(1, -1), "loss_mask": torch.ones(1, 34)}, -1,
                           lengths),
                    packer.pack_flat({"tokens": tokens, "loss_mask": torch.ones(34)}, lengths)):
            mask = out["padding_mask"]
            assert mask.dtype == torch.bool and mask.shape == out["tokens"].shape
            assert torch.equal(mask, out["tokens"] == 0)
            assert "_real_token" not in out
        seen += out["tokens"][~mask].tolist()
    assert sorted(seen) == tokens.tolist()
    assert (out["tokens"].numel() * cp) % (2 * cp * multiple if cp > 1 else multiple) == 0


def test_padding_mask_of_an_empty_bin_and_without_experts() -> None:
    empty = DocumentPacker(BALANCED, 2, 0, 1, None, padding_mask=True).pack_flat(
        {"tokens": torch.zeros(0, dtype=torch.long)}, [])
    assert empty["padding_mask"].all()
    plain = DocumentPacker(TE, 2, 0, 1, None)({"tokens": torch.arange(1, 7).view(1, -1)}, -1,
                                              [6])
    assert "padding_mask" not in plain


def test_dp_balance_is_off_by_default_with_a_load_balancing_loss() -> None:
    for flags, on in ((["--moe-aux-loss-coeff", "0.01"], False),
                      (["--moe-router-load-balancing-type", "seq_aux_loss",
                        "--moe-aux-loss-coeff", "0.01"], False),
                      (["--moe-router-load-balancing-type", "sinkhorn"], False),
                      ([], True),  # aux_loss with coefficient 0: top-k routing alone
                      (["--moe-router-load-balancing-type", "none"], True)):
        args = parse_args([*DP2_CP2, *MOE, *flags])
        assert args.data_parallel_size == 2
        assert args.mesh_balance_data_parallel is on, flags


@pytest.mark.parametrize("flags, message", [
    ([*DP2_CP2, *MOE, "--moe-aux-loss-coeff", "0.01", "--mesh-balance-data-parallel"],
     "--mesh-balance-data-parallel with --num-experts: megatron-core computes the "
     "load-balancing loss (aux_loss, --moe-aux-loss-coeff 0.01) over each micro-batch's tokens, "
     "so regrouping the documents would change the loss and its gradients; use "
     "--no-mesh-balance-data-parallel"),
    ([*DP2_CP2, *MOE, "--moe-router-load-balancing-type", "sinkhorn",
      "--mesh-balance-data-parallel"],
     "--moe-router-load-balancing-type sinkhorn routes by balancing each micro-batch's tokens"),
    (["--config", TINY, "--mock-data", *MOE, "--tensor-model-parallel-size", "2"],
     "--num-experts 4 with --tensor-model-parallel-size 2 needs --sequence-parallel"),
])
def test_moe_flags_refused_before_any_process_group(flags: list[str], message: str) -> None:
    """The driver's flag checks (parse_args: no process group yet) refuse them in one line;
    main turns that into exit 2 (tests/distributed/test_moe_documents.py runs one)."""
    with pytest.raises(ConfigError) as refused:
        parse_args(flags)
    assert message in str(refused.value) and "\n" not in str(refused.value)
