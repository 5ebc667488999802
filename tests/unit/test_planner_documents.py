"""The planner with packed documents: compute counts in-document pairs only, bytes do not
change (every rank holds a share of every document), and bad lengths exit 2."""
from __future__ import annotations

import pytest

from megatron_mesh.cli import main
from megatron_mesh.planner import plan

MODEL = dict(seq_length=65536, num_heads=32, num_kv_heads=8, head_dim=128)


def test_documents_shrink_compute_by_the_sum_of_squares_and_keep_the_bytes() -> None:
    whole = plan(16, **MODEL)
    lengths = (32768, 16384, 8192, 8192)
    packed = plan(16, **MODEL, doc_lengths=lengths)
    # in-document pairs, n (n + 1) / 2 each, over the dense count S^2 / 2: about 0.3125
    share = sum(n * (n + 1) for n in lengths) / MODEL["seq_length"] ** 2
    for name in ("forward", "backward"):
        assert packed.ring.compute_s[name] == pytest.approx(share * whole.ring.compute_s[name])
    before = {e.label: e.total_bytes for e in whole.estimates}
    after = {e.label: e.total_bytes for e in packed.estimates}
    both = before.keys() & after.keys()  # a2a+p2p's label names the shape it picked
    assert len(both) > 10 and all(before[k] == after[k] for k in both)


@pytest.mark.parametrize("flags, words", [
    (["--doc-length", "5000"], ["--doc-length 5000", "does not divide"]),
    (["--doc-lengths", "1024,2048"], ["summing to --seq-length 65536", "3072"]),
    (["--doc-lengths", "a,b"], ["comma-separated"]),
])
def test_bad_document_lengths_exit_2_naming_them(flags, words, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--gpus", "16", "--seq-length", "65536", "--num-heads", "32",
              "--head-dim", "128", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
