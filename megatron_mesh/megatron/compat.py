"""The megatron-core APIs that changed between 0.16.1 and 0.19.x, one function each.

Every other module calls these instead of branching on the version itself. Supported:
megatron-core 0.16.1 up to 0.19.x (SUPPORTED); each guard names the release that changed
the API.
"""
from __future__ import annotations

import functools
import warnings

import torch
from packaging.version import Version

__all__ = [
    "MEGATRON_CORE_VERSION",
    "SUPPORTED",
    "check_supported_version",
    "have_transformer_engine",
    "mla_unbuildable_reason",
    "get_batch_on_this_cp_rank",
    "define_moe_names_without_te",
    "null_tokenizer_library",
    "null_tokenizer_options",
]

SUPPORTED = (Version("0.16.1"), Version("0.20"))
"""[lowest, first unsupported) megatron-core versions; both ends are tested in CI."""


@functools.cache
def have_transformer_engine() -> bool:
    """Whether Transformer Engine is installed (found, not imported: importing it is slow
    and needs CUDA libraries; the layers that use it import it themselves)."""
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _installed_version() -> Version:
    from megatron.core import package_info

    return Version(package_info.__version__)


MEGATRON_CORE_VERSION: Version = _installed_version()
"""The installed megatron-core release."""

_HYBRID_CP_BATCHES = Version("0.18")
"""0.18 made get_batch_on_this_cp_rank take `is_hybrid_cp` (positional) and stopped
defaulting its group to the CP group."""
_NULL_TEXT_TOKENIZER = Version("0.17")
"""0.17 renamed the NullTokenizer's metadata library 'null' to 'null-text'."""
_MLA_WITHOUT_TE = Version("0.17")
"""0.17 builds MLASelfAttention without Transformer Engine (0.16's __init__ checks
`isinstance(linear_proj, TELinear)` against the stand-in class its TE extension defines when
TE is missing, which raises TypeError)."""


def check_supported_version(version: Version = MEGATRON_CORE_VERSION) -> None:
    """RuntimeError for a megatron-core older than SUPPORTED; a warning for a newer one."""
    low, high = SUPPORTED
    release = Version(version.base_version)
    if release < low:
        raise RuntimeError(
            f"megatron-core {version} is too old: megatron-mesh needs >={low},<{high} "
            f"(pip install 'megatron-core>={low},<{high}')"
        )
    if release >= high:
        warnings.warn(
            f"megatron-core {version} is newer than megatron-mesh was tested with "
            f"(>={low},<{high})", stacklevel=2,
        )


def mla_unbuildable_reason(version: Version = MEGATRON_CORE_VERSION,
                           transformer_engine: bool | None = None) -> str | None:
    """Why this megatron-core cannot build multi-latent attention (MLASelfAttention), or None
    when it can: megatron-core 0.17 or later, or Transformer Engine installed."""
    te = have_transformer_engine() if transformer_engine is None else transformer_engine
    if Version(version.base_version) >= _MLA_WITHOUT_TE or te:
        return None
    return (f"megatron-core {version} cannot build multi-latent attention without Transformer "
            "Engine (its MLASelfAttention tests isinstance against TE's stand-in TELinear, "
            "which raises TypeError)")


def define_moe_names_without_te() -> None:
    """megatron-core 0.16 without Transformer Engine: `moe_utils` defines `te_general_gemm`
    only when TE imports, yet its router gating reads it (NameError in every MoE forward).
    Define it as None, what 0.17 and later define it as without TE; a no-op otherwise."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def get_batch_on_this_cp_rank(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This CP rank's two zigzag chunks of every [b, s, ...] tensor of `batch`."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank as split

    group = parallel_state.get_context_parallel_group()
    if MEGATRON_CORE_VERSION >= _HYBRID_CP_BATCHES:
        return split(batch, False, cp_group=group)
    return split(batch, cp_group=group)


@functools.cache
def null_tokenizer_library() -> str:
    """The metadata 'library' under which MegatronTokenizer builds a NullTokenizer."""
    return "null-text" if MEGATRON_CORE_VERSION >= _NULL_TEXT_TOKENIZER else "null"



def null_tokenizer_options(vocab_size: int) -> dict[str, int]:
    """MegatronTokenizer.from_pretrained keywords for a NullTokenizer over ids 0 .. V - 1 plus
    its end-of-document id V (V + 1 ids in all, as Megatron-LM's ``--vocab-size V`` means).

    Up to 0.16 the NullTokenizer adds the EOD id V itself; 0.17 takes the full vocabulary and
    an ``eod_id`` (default V - 1), so it gets V + 1 and V.
    """
    if MEGATRON_CORE_VERSION >= _NULL_TEXT_TOKENIZER:
        return {"vocab_size": vocab_size + 1, "eod_id": vocab_size}
    return {"vocab_size": vocab_size}
