"""The model description a checkpoint saves and generation compares: every flag of the driver
is a model flag or named with the reason it does not change the model's outputs; the
checkpoint's values are defaults under --config and the command line; differences are named
with both values."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_mesh.training.checkpoints.checksums import CheckpointError
from megatron_mesh.training.checkpoints.model_description import (
    MODEL_FLAGS,
    OTHER_FLAGS,
    SAVED_FLAGS,
    checked_description,
    completed,
    describe,
    differences,
    unrecorded,
)
from megatron_mesh.training.config.arguments import build_parser, parse_args

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml")
PARSER = build_parser()


@pytest.fixture(autouse=True)
def _world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")


def test_every_flag_is_a_model_flag_or_named_as_not_changing_the_model() -> None:
    """A flag added to the parser fails here until it is put in MODEL_FLAGS (saved with every
    checkpoint, compared by generate) or in OTHER_FLAGS with its reason."""
    flags = {a.dest for a in build_parser()._actions} - {"help", "config"}
    assert len(set(MODEL_FLAGS)) == len(MODEL_FLAGS)
    assert not set(MODEL_FLAGS) & set(OTHER_FLAGS)
    assert sorted(flags - set(MODEL_FLAGS) - set(OTHER_FLAGS)) == [], "classify these flags"
    assert sorted((set(MODEL_FLAGS) | set(OTHER_FLAGS)) - flags) == [], "no such flags"
    assert all(why.strip() for why in OTHER_FLAGS.values())


def test_the_description_holds_every_model_flag() -> None:
    args = parse_args(["--config", TINY])
    saved = describe(args)
    assert tuple(saved) == SAVED_FLAGS and set(MODEL_FLAGS) <= set(saved)
    assert unrecorded(saved) == [] and differences(saved, args) == []


def test_the_checkpoints_values_are_defaults_under_the_config_and_the_command_line() -> None:
    """Precedence: built-in < checkpoint < --config < command line."""
    ckpt = {"norm_epsilon": 1e-3, "rotary_base": 500, "normalization": "LayerNorm",
            "softmax_type": "off-by-one", "window_size": (8, 0)}
    args = parse_args(["--config", TINY, "--norm-epsilon", "1e-6"], defaults=ckpt)
    assert args.norm_epsilon == 1e-6  # the command line
    assert args.normalization == "RMSNorm"  # tiny-cpu.yaml
    assert (args.rotary_base, args.softmax_type, args.window_size) == (500, "off-by-one", (8, 0))


def test_differences_name_each_flag_and_both_values() -> None:
    saved = describe(parse_args(["--config", TINY]))
    args = parse_args(["--config", TINY, "--window-size", "8", "0", "--window-attn-skip-freq", "2",
                       "--rotary-base", "500", "--softmax-type", "learnable", "--qk-layernorm",
                       "--num-experts", "4", "--max-position-embeddings", "128"])
    assert differences(saved, args) == [
        "--rotary-base 10000, the flags say 500",
        "--window-size unset, the flags say 8 0",
        "--window-attn-skip-freq unset, the flags say 2",
        "--softmax-type vanilla, the flags say learnable",
        "--qk-layernorm off, the flags say on",
        "--num-experts unset, the flags say 4",
        "--moe-ffn-hidden-size unset, the flags say 128",
    ]  # RoPE has no position table: a longer --max-position-embeddings is allowed


def test_learned_positions_pin_the_position_tables_length() -> None:
    learned = ["--config", TINY, "--position-embedding-type", "learned_absolute"]
    saved = describe(parse_args(learned))
    assert differences(saved, parse_args([*learned, "--max-position-embeddings", "128"])) == [
        "--max-position-embeddings 64, the flags say 128"]
    saved["window_size"] = [8, 0]  # a list where the flags hold a tuple: the same window
    assert differences(saved, parse_args([*learned, "--window-size", "8", "0"])) == []


def test_an_older_description_names_what_it_does_not_record() -> None:
    saved = describe(parse_args(["--config", TINY]))
    old = {k: v for k, v in saved.items() if k not in ("rotary_base", "softmax_type")}
    assert unrecorded(old) == ["rotary_base", "softmax_type"]
    assert differences(old, parse_args(["--config", TINY, "--rotary-base", "500"])) == []


def test_a_description_no_command_line_could_give_is_refused_by_flag() -> None:
    """A saved description's values took the place of the parser's defaults unchecked:
    --hidden-size 64.5 ran into a misleading vocabulary message. Each value is checked
    against its flag (integer, number, switch, choice, two values, unset where allowed)."""
    saved = describe(parse_args(["--config", TINY]))
    assert checked_description({"model_shape": saved}, "ckpt", PARSER) == saved
    assert checked_description({}, "ckpt", PARSER) == {}
    chunked = {**saved, "attention_chunk_size": 8, "no_rope_freq": 2}
    assert checked_description({"model_shape": chunked}, "ckpt", PARSER) == chunked
    listed = {**saved, "no_rope_freq": [0, 1]}  # the flags' own parsers read them back
    assert checked_description({"model_shape": listed}, "ckpt", PARSER) == listed
    for key, value, why in (("hidden_size", 64.5, "not an integer"),
                            ("num_layers", True, "not an integer"),
                            ("norm_epsilon", "1e-5", "not a finite number"),
                            ("swiglu", 1, "not on / off"),
                            ("normalization", "BatchNorm", "not one of LayerNorm, RMSNorm"),
                            ("window_size", [8], "not 2 values"),
                            ("attention_chunk_size", 0, "not a value the flag takes"),
                            ("no_rope_freq", [0, 2], "not a value the flag takes"),
                            ("hidden_size", None, "unset, and the flag has no unset value")):
        with pytest.raises(CheckpointError) as e:
            checked_description({"model_shape": {**saved, key: value}}, "ckpt", PARSER)
        assert str(e.value) == (f"checkpoint ckpt: its model description has --"
                                f"{key.replace('_', '-')} {value!r}, {why}: give another "
                                "checkpoint"), str(e.value)
    with pytest.raises(CheckpointError, match="model_shape in common.pt\\) is a list, not a "
                                              "mapping"):
        checked_description({"model_shape": [64, 2]}, "ckpt", PARSER)


def test_the_first_descriptions_imply_the_gqa_switch_by_the_group_count() -> None:
    first = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
             "seq_length": 64, "ffn_hidden_size": 128}
    assert completed(first)["group_query_attention"] is True
    assert completed({**first, "num_query_groups": 4})["group_query_attention"] is False
    assert "group_query_attention" not in completed({**first, "num_query_groups": None})
    assert completed({**first, "group_query_attention": False})["group_query_attention"] is False
