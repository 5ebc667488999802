"""The one decision of which attention op runs a tile, made from facts and returned as a value.

Order for 'auto' on CUDA: Transformer Engine (when installed and its own backend query
accepts the tile; asked per tile shape inside `te_fused.TEFusedKernel`), then torch's cuDNN
op (sm80 to sm121, cuDNN >= 9, fp16 / bf16, Q/K's and V's head dims each a multiple of 8
up to 128), then torch's flash op (sm80+, fp16 / bf16, the larger head dim a multiple of 8
up to 256: V of its own head dim is padded for it), then torch's memory-efficient op (any
CUDA GPU and dtype). V's head dim (`v_head_dim`, multi-latent attention) is decided here
too: TE's query is given it per tile, torch's cuDNN op takes it (its output and dV have
V's head dim), the flash op pads. 'te' and 'cudnn' put their op first and raise
when it cannot run at all; 'torch' starts at flash. Every skip comes with its reason,
logged once per distinct reason (`log_skips`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import log_once

HALF = (torch.float16, torch.bfloat16)
SM80 = (8, 0)
CUDNN_MAX_ARCH = (12, 1)  # torch's cuDNN attention takes sm80 to sm121
MIN_CUDNN = 90000  # cuDNN 9: torch's cuDNN attention op needs it
CUDNN_MAX_HEAD_DIM = 128
FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class DeviceFacts:
    """What the choice depends on besides the tensors: the device type, its compute
    capability (None off CUDA), the runtime cuDNN version (e.g. 90100; None when absent),
    whether torch has the cuDNN attention op, and whether a supported TE is importable."""

    type: str
    capability: tuple[int, int] | None = None
    cudnn: int | None = None
    torch_has_cudnn_op: bool = True
    te: str | None = None  # why Transformer Engine cannot be used; None when it can

    @staticmethod
    def of(device: torch.device, want_te: bool) -> DeviceFacts:
        """The facts of `device`; TE is looked at (and imported) only when `want_te`."""
        device = torch.device(device)
        has_op = hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
        if device.type != "cuda":
            return DeviceFacts(device.type, torch_has_cudnn_op=has_op,
                               te=f"tensors are on {device.type}, Transformer Engine needs CUDA")
        cap = torch.cuda.get_device_capability(device)
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        te_why = "not asked for"
        if want_te:
            from . import te_fused

            te_why = te_fused.unavailable()
        return DeviceFacts("cuda", tuple(cap), cudnn, has_op, te_why)


@dataclass(frozen=True)
class Choice:
    """The ops to use, best first (each 'te', 'cudnn', 'flash', 'efficient', 'cpu' or
    'flex'), and (op, reason) for every op passed over."""

    ops: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def first(self) -> str:
        return self.ops[0]


def cudnn_unsupported(facts: DeviceFacts, dtype: torch.dtype | None,
                      head_dim: int | None, v_head_dim: int | None = None) -> str | None:
    """Why torch's cuDNN attention op cannot run these tiles, or None. `v_head_dim`: V's
    head dim where it differs from Q's and K's (None: the same); both are checked."""
    if not facts.torch_has_cudnn_op:
        return f"torch {torch.__version__} has no _scaled_dot_product_cudnn_attention op"
    if facts.type == "meta":
        pass  # shapes only: no GPU or cuDNN is needed to check the calls
    elif facts.type != "cuda":
        return f"tensors are on {facts.type}, cuDNN attention needs CUDA"
    else:
        if facts.capability is None or not SM80 <= facts.capability <= CUDNN_MAX_ARCH:
            return (f"GPU sm{_sm(facts.capability)}: torch's cuDNN attention needs sm80 to "
                    f"sm{_sm(CUDNN_MAX_ARCH)}")
        if facts.cudnn is None or facts.cudnn < MIN_CUDNN:
            return f"cuDNN {facts.cudnn or 'not available'}; cuDNN attention needs cuDNN >= 9"
    if dtype is None or head_dim is None:
        return "dtype and head dim not given"
    if dtype not in HALF:
        return f"dtype {dtype} is not one of float16, bfloat16"
    for what, dim in (("head dim", head_dim), ("V head dim", v_head_dim)):
        if dim is not None and (dim % 8 or dim > CUDNN_MAX_HEAD_DIM):
            return f"{what} {dim} is not a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}"
    return None


def flash_unsupported(facts: DeviceFacts, dtype: torch.dtype | None,
                      head_dim: int | None) -> str | None:
    """Why torch's CUDA flash op cannot run these tiles, or None."""
    if facts.type == "cuda" and (facts.capability is None or facts.capability < SM80):
        return f"GPU sm{_sm(facts.capability)}: torch's flash attention needs sm80 or newer"
    if dtype is not None and dtype not in HALF:
        return f"dtype {dtype}: the flash op takes float16 / bfloat16"
    if head_dim is not None and (head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM):
        return f"head dim {head_dim} is not a multiple of 8 up to {FLASH_MAX_HEAD_DIM}"
    return None


def choose(backend: str, facts: DeviceFacts, dtype: torch.dtype | None,
           head_dim: int | None, v_head_dim: int | None = None) -> Choice:
    """The ops for `backend` ('auto' | 'torch' | 'cudnn' | 'te' | 'flex') given the device
    facts, for tiles of Q/K head dim `head_dim` and V head dim `v_head_dim` (None: the same);
    'flex' is FlexAttention's one op wherever it is asked for.

    ValueError (saying why) when 'te' or 'cudnn' cannot run at all. Off CUDA (and on
    'meta' for 'auto' / 'torch'): 'cpu' on CPU, else the CUDA torch ops.
    """
    if backend == "flex":  # FlexAttention, by name only ('auto' never chooses it)
        return Choice(("flex",))
    if facts.type == "cpu" and backend in ("auto", "torch"):
        return Choice(("cpu",))
    skipped: list[tuple[str, str]] = []
    ops: list[str] = []
    if facts.type != "cuda" and backend == "auto":
        backend = "torch"  # 'meta': the torch ops' CUDA calls, checked for shapes only
    if backend in ("auto", "te"):
        why = facts.te if facts.type == "cuda" else (
            f"tensors are on {facts.type}, Transformer Engine needs CUDA")
        if why is None and dtype is not None and dtype not in HALF:
            why = f"dtype {dtype}: TE's fused attention takes float16 / bfloat16"
        if why is None:
            ops.append("te")
        elif backend == "te":
            raise ValueError(f"backend='te' cannot run here: {why}; install "
                             "transformer-engine[pytorch] or use backend='cudnn' or 'torch'")
        else:
            skipped.append(("te", why))
    if backend in ("auto", "te", "cudnn"):
        why = cudnn_unsupported(facts, dtype, head_dim, v_head_dim)
        if why is None:
            ops.append("cudnn")
        elif backend == "cudnn":
            raise ValueError(f"backend='cudnn' cannot run here: {why}; use backend='torch'")
        else:
            skipped.append(("cudnn", why))
    padded = head_dim if head_dim is None or v_head_dim is None else max(head_dim, v_head_dim)
    why = flash_unsupported(facts, dtype, padded)  # V of its own head dim is padded for it
    if why is None:
        ops.append("flash")
    else:
        skipped.append(("flash", why))
    ops.append("efficient")
    return Choice(tuple(ops), tuple(skipped))


# The --mesh-kernel name (`layer_plan.BACKEND_NAMES`) of each op a choice may start with
OP_BACKENDS = {"te": "te", "cudnn": "cudnn", "flash": "torch", "efficient": "torch",
               "cpu": "torch", "flex": "flex"}


def backend_of(choice: Choice) -> str:
    """The backend name of the op `choice` runs first (torch's ops: 'torch')."""
    return OP_BACKENDS[choice.first]


def log_skips(choice: Choice, what: str) -> None:
    """Logs each (op, reason) of `choice.skipped` once per process."""
    for op, why in choice.skipped:
        log_once(f"{what}: {op} not used: {why}")


def _sm(cap: tuple[int, int] | None) -> str:
    return "?" if cap is None else f"{cap[0]}{cap[1]}"
