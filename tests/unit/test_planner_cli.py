"""`megatron-mesh plan`: the driver flags of its choice (parsed by the driver's own flag
parser), tensor parallelism (heads and GPUs per node divided, as the driver's own choice of
a grid divides them; bad sizes exit 2), and the --plot figure (the choice drawn, missing
points explained, plain GPU counts on the x axis)."""
from __future__ import annotations

import argparse
import json
import shlex

import pytest

from megatron_mesh.cli import main
from megatron_mesh.megatron.arguments import add_mesh_args
from megatron_mesh.megatron.shape import auto_mesh_shape, resolve_mesh_shape
from megatron_mesh.planner import plan
from megatron_mesh.planner.reports.plot import gpu_counts

MODEL = ["--seq-length", "131072", "--hidden-size", "4096", "--num-heads", "32",
         "--num-kv-heads", "8"]


def run(capsys, *flags: str) -> str:
    assert main(["plan", *flags]) == 0
    return capsys.readouterr().out


def printed_flags(out: str) -> list[str]:
    """The line after 'driver flags of the choice ...:'."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("driver flags of the choice"))
    return shlex.split(lines[at + 1])


def driver_parser() -> argparse.ArgumentParser:
    """The driver's mesh flags plus the Megatron-LM flags they go with."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--context-parallel-size", type=int, required=True)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    return add_mesh_args(parser)


def test_plan_prints_the_driver_flags_of_its_choice(capsys) -> None:
    out = run(capsys, "--gpus", "64", *MODEL)
    flags = printed_flags(out)
    assert flags == ["--context-parallel-size", "64", "--cp-comm-type", "mesh",
                     "--mesh-shape", "4x16x1"]
    assert "mesh 4x16x1 +" in out  # the table's choice
    args = driver_parser().parse_args(flags)
    assert resolve_mesh_shape(args.context_parallel_size, args.mesh_shape)[0] == (4, 16, 1)
    assert args.mesh_schedule == "streamed" and args.mesh_grad_reduce_dtype == "mixed"
    out = run(capsys, "--gpus", "64", *MODEL, "--mesh-schedule", "gathered",
              "--mesh-grad-reduce-dtype", "fp32", "--json")
    data = json.loads(out)
    args = driver_parser().parse_args(data["driver_flags"])
    assert (args.mesh_schedule, args.mesh_grad_reduce_dtype) == ("gathered", "fp32")
    assert list(args.mesh_shape) == data["best_grid"]


def test_plan_flags_name_the_mask_it_priced(capsys) -> None:
    """Packed documents and a sliding window are in the printed flags, as the driver's own
    parser reads them: documents masked and placed, the window and its global layers."""
    from megatron_mesh.training.config.arguments import build_parser

    driver = build_parser()
    docs = printed_flags(run(capsys, "--gpus", "64", *MODEL, "--doc-length", "4096"))
    args = driver.parse_args(docs)
    assert args.reset_attention_mask and args.mesh_document_placement == "balanced", docs
    window = printed_flags(run(capsys, "--gpus", "64", *MODEL, "--window-size", "4096",
                               "--window-attn-skip-freq", "4"))
    args = driver.parse_args(window)
    assert args.window_size == [4096, 0] and args.window_attn_skip_freq == 4, window
    assert not args.reset_attention_mask and args.mesh_document_placement is None
    plain = printed_flags(run(capsys, "--gpus", "64", *MODEL))
    assert not {"--reset-attention-mask", "--window-size"} & set(plain), plain


def test_tensor_parallel_divides_heads_and_gpus_as_the_driver_does(capsys) -> None:
    out = run(capsys, "--gpus", "128", "--tensor-model-parallel-size", "2", *MODEL, "--json")
    data = json.loads(out)
    api = plan(64, seq_length=131072, num_heads=16, num_kv_heads=4, head_dim=128,
               gpus_per_node=4)
    assert data["cluster"]["gpus"] == 64 and data["cluster"]["gpus_per_node"] == 4
    assert [e["bytes"]["total"] for e in data["estimates"]] == [
        e.total_bytes for e in api.estimates]
    driver = auto_mesh_shape(64, 32, 8, 128, 131072, cp_ranks_per_node=4,
                             tensor_parallel_size=2)
    assert data["best_grid"] == list(driver) == list(api.best_grid.grid_shape)
    args = driver_parser().parse_args(data["driver_flags"])
    assert (args.tensor_model_parallel_size, args.context_parallel_size) == (2, 64)
    assert tuple(args.mesh_shape) == tuple(driver)
    text = run(capsys, "--gpus", "128", "--tensor-model-parallel-size", "2", *MODEL)
    assert text.startswith("tensor parallelism 2: each TP rank holds 16 q / 4 kv heads; "
                           "context parallelism over 128 GPUs / TP 2 = 64 CP ranks, 4 per node")
    assert "\ncontext parallelism over 64 CP ranks of 2 GPUs each (16 node(s) x 4 CP ranks)\n" in text


def test_help_defines_gpus_and_tensor_parallelism(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "CP = --gpus / TP and CP ranks per node = --gpus-per-node / TP" in text
    assert "GPUs sharing one sequence, TP x CP" in text


@pytest.mark.parametrize("flags, words", [
    (["--gpus", "64", "--tensor-model-parallel-size", "3"],
     "--tensor-model-parallel-size 3 does not divide --num-heads 32; valid sizes here: 1, 2, 4, 8"),
    (["--gpus", "64", "--tensor-model-parallel-size", "16"],
     "--tensor-model-parallel-size 16 does not divide --num-kv-heads 8"),
    (["--gpus", "64", "--gpus-per-node", "4", "--tensor-model-parallel-size", "8"],
     "--tensor-model-parallel-size 8 does not divide --gpus-per-node 4; valid sizes here: 1, 2, 4"),
    (["--gpus", "6", "--tensor-model-parallel-size", "4"],
     "--tensor-model-parallel-size 4 does not divide --gpus 6"),
    (["--gpus", "8", "--tensor-model-parallel-size", "8"],
     "--gpus 8 / --tensor-model-parallel-size 8 leaves a context-parallel size of 1; give "
     "--gpus >= 16"),
    (["--gpus", "64", "--tensor-model-parallel-size", "0"],
     "argument --tensor-model-parallel-size: '0' is not a positive integer"),
])
def test_bad_tensor_parallel_sizes_exit_2_naming_them(flags, words, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", *flags, *MODEL])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and words in err.splitlines()[-1] and "Traceback" not in err


def test_plot_draws_the_choice_and_says_why_a2a_stops() -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the 'plot' extra (matplotlib)")
    from matplotlib import pyplot

    from megatron_mesh.planner.reports.plot import figure

    plans = [plan(n, seq_length=131072, num_heads=32, num_kv_heads=32, head_dim=128)
             for n in gpu_counts(64, 131072)]
    for tp in (1, 2):
        fig = figure(plans, tp)
        ax = fig.axes[0]
        fig.canvas.draw()
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert ticks == [str(n * tp) for n in (2, 4, 8, 16, 32, 64)]
        lines = {line.get_label(): line for line in ax.get_lines()}
        choice = lines["planner's choice"]
        assert list(choice.get_ydata()) == [p.speedup(p.best_grid) for p in plans]
        a2a = next(k for k in lines if k.startswith("a2a ("))
        assert a2a == (f"a2a (none at {64 * tp} GPUs: needs the heads (per TP rank) divisible "
                       "by the CP size)")
        assert list(lines[a2a].get_xdata()) == [n * tp for n in (2, 4, 8, 16, 32)]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend[:2] == ["planner's choice", "best 2D mesh"] and a2a in legend
        pyplot.close(fig)
