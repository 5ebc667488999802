"""The driver's multi-latent attention flags: Megatron-LM's names and defaults, bad values
exiting 2 with the value named, MLA sizes without --multi-latent-attention refused, and the
megatron-core check (0.16 cannot build MLA without Transformer Engine)."""
from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from megatron_mesh.megatron.compat import mla_unbuildable_reason
from megatron_mesh.pretrain_gpt import main
from megatron_mesh.training.config.arguments import ConfigError, parse_args

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
# tiny-cpu.yaml has GQA (2 query groups), which MLA excludes
MLA = ["--config", TINY, "--multi-latent-attention", "--no-group-query-attention",
       "--num-query-groups", "4"]
BUILDABLE = mla_unbuildable_reason() is None


@pytest.fixture(autouse=True)
def _world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")


def _exit_and_error(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's own errors
        code = exit_info.code
    return code, capsys.readouterr().err


def test_megatron_lm_defaults_and_no_mla_by_default() -> None:
    """Megatron-LM's defaults (core_v0.16.1 and core_v0.19: --q-lora-rank none, --kv-lora-rank
    32, --qk-head-dim 128, --qk-pos-emb-head-dim 64, --v-head-dim 128), unused without the flag:
    the core attention's head dims are --kv-channels."""
    args = parse_args(["--config", TINY])
    assert args.multi_latent_attention is False
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim,
            args.v_head_dim) == (None, 32, 128, 64, 128)
    assert args.k_channels == args.v_channels == args.kv_channels == 16


def test_attention_head_dims_of_megatron_lm_arguments() -> None:
    """What the mesh's shape planner and the driver size the core attention with, from
    Megatron-LM's argument names (also those of a patched Megatron-LM)."""
    from argparse import Namespace

    from megatron_mesh.megatron.arguments import attention_head_dims

    mla = Namespace(multi_latent_attention=True, qk_head_dim=16, qk_pos_emb_head_dim=8,
                    v_head_dim=12, kv_channels=None, hidden_size=64, num_attention_heads=4)
    assert attention_head_dims(mla) == (24, 12)
    assert attention_head_dims(Namespace(**{**vars(mla), "multi_latent_attention": False})) == (
        16, 16)
    assert attention_head_dims(Namespace(kv_channels=32)) == (32, 32)


@pytest.mark.skipif(not BUILDABLE, reason="needs a GPU: MLA is refused here without Transformer "
                    "Engine, which needs CUDA (see test_refused_where_...; scripts/test_mcore019.sh "
                    "runs it on megatron-core 0.19)")
def test_mla_head_dims_are_decided_with_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """And the mesh's shape is chosen for them (no GQA: 4 K/V heads)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args([*MLA, "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
                       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
                       "--context-parallel-size", "4", "--cp-comm-type", "mesh"])
    assert args.multi_latent_attention and args.q_lora_rank == 32 and args.kv_lora_rank == 16
    assert (args.k_channels, args.v_channels) == (24, 12)  # Q / K: 16 + 8 RoPE; V its own
    assert args.kv_channels is None and args.num_query_groups == 4
    assert args.mesh_shape_chosen_by_planner and len(args.mesh_shape) == 3
    monkeypatch.setenv("WORLD_SIZE", "1")
    default = parse_args(MLA)  # Megatron-LM's sizes
    assert (default.k_channels, default.v_channels, default.q_lora_rank) == (192, 128, None)


def test_refused_where_megatron_core_cannot_build_mla(capsys: pytest.CaptureFixture) -> None:
    """Decided from the version and whether TE is installed; on this megatron-core the driver
    builds MLA or exits 2 at the flag check, naming the flag and what would work."""
    assert mla_unbuildable_reason(Version("0.17.0"), transformer_engine=False) is None
    assert mla_unbuildable_reason(Version("0.16.1"), transformer_engine=True) is None
    reason = mla_unbuildable_reason(Version("0.16.1"), transformer_engine=False)
    assert reason is not None and "megatron-core 0.16.1" in reason
    if BUILDABLE:
        return
    code, err = _exit_and_error(MLA, capsys)
    assert code == 2
    assert "--multi-latent-attention: megatron-core" in err and (
        "use megatron-core >= 0.17 (0.19.2 is tested) or install Transformer Engine") in err, err


@pytest.mark.parametrize("flags, message", [
    (["--v-head-dim", "0"], "--v-head-dim 0: must be a positive integer"),
    (["--v-head-dim", "-12"], "--v-head-dim -12: must be a positive integer"),
    (["--qk-head-dim", "0"], "--qk-head-dim 0: must be a positive integer"),
    (["--qk-head-dim", "-16"], "--qk-head-dim -16: must be a positive integer"),
    (["--qk-pos-emb-head-dim", "0"], "--qk-pos-emb-head-dim 0: must be a positive integer"),
    (["--kv-lora-rank", "-1"], "--kv-lora-rank -1: must be a positive integer"),
    (["--q-lora-rank", "0"], "--q-lora-rank 0: must be a positive integer"),
    (["--group-query-attention", "--num-query-groups", "2"],
     "--multi-latent-attention and --group-query-attention are exclusive"),
    (["--kv-channels", "16"], "--kv-channels 16 with --multi-latent-attention"),
    (["--attention-backend", "local"], "--attention-backend local with --multi-latent-attention"),
])
def test_bad_mla_values_exit_2_naming_them(flags: list[str], message: str,
                                          capsys: pytest.CaptureFixture) -> None:
    """Checked before the megatron-core check, so on every version."""
    code, err = _exit_and_error([*MLA, *flags], capsys)
    assert code == 2 and message in err, err


def test_v_head_dim_missing_exits_2_naming_it(tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    """--v-head-dim without a value (argparse), or null in a config."""
    code, err = _exit_and_error([*MLA, "--v-head-dim"], capsys)
    assert code == 2 and "--v-head-dim: expected one argument" in err, err
    config = tmp_path / "mla.yaml"
    config.write_text(Path(TINY).read_text() + "\nmulti-latent-attention: true\n"
                      "group-query-attention: false\nnum-query-groups: 4\nv-head-dim: null\n")
    code, err = _exit_and_error(["--config", str(config)], capsys)
    assert code == 2 and "--v-head-dim None: must be a positive integer" in err, err


@pytest.mark.parametrize("flag, value", [("--q-lora-rank", "32"), ("--kv-lora-rank", "16"),
                                         ("--qk-head-dim", "16"), ("--qk-pos-emb-head-dim", "8"),
                                         ("--v-head-dim", "12")])
def test_mla_sizes_without_mla_are_refused(flag: str, value: str) -> None:
    """As --window-attn-skip-freq without --window-size: a size that would do nothing."""
    with pytest.raises(ConfigError, match=f"{flag} {value} needs --multi-latent-attention"):
        parse_args(["--config", TINY, flag, value])
    # Megatron-LM's default value changes nothing, so it is accepted (a copied command line)
    if flag != "--q-lora-rank":
        parse_args(["--config", TINY, flag, {"--kv-lora-rank": "32", "--qk-head-dim": "128",
                                             "--qk-pos-emb-head-dim": "64",
                                             "--v-head-dim": "128"}[flag]])
