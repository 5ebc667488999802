"""Per-interval figures: the Megatron-LM style log line and the same numbers to wandb."""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_mesh.layer_plan import shape_text
from megatron_mesh.megatron.arguments import mesh_active
from megatron_mesh.training.config.training_config import as_dict
from megatron_mesh.training.job.device import has_cuda
from megatron_mesh.training.model.moe import AUX_LOSS_NAMES

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig


def perplexity(loss: float) -> float:
    """exp(loss), the exponent capped at 20 as Megatron-LM reports it."""
    return math.exp(min(20.0, loss))


@dataclass
class IntervalStats:
    """Sums over the iterations since the last log line."""

    iterations: int = 0
    loss_sum: float = 0.0
    time_sum: float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    traffic_bytes: int = 0
    skipped: int = 0
    aux_sums: dict[str, float] = field(default_factory=dict)  # MoE aux losses by name

    def add(self, loss: float, seconds: float, grad_norm: float | None, traffic: int,
            ok: bool, aux: dict[str, float] | None = None) -> None:
        self.iterations += 1
        for name, value in (aux or {}).items():
            self.aux_sums[name] = self.aux_sums.get(name, 0.0) + value
        self.loss_sum += loss
        self.time_sum += seconds
        self.traffic_bytes += traffic
        self.skipped += 0 if ok else 1
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)


def interval_metrics(stats: IntervalStats, args: TrainingConfig, flops_per_iter: float,
                     lr: float, consumed: int, peak_mem: int, traffic_known: bool) -> dict:
    """The numbers of one log line, keyed as they go to wandb."""
    n = max(stats.iterations, 1)
    step_s = stats.time_sum / n
    tokens = args.training.global_batch_size * args.training.seq_length
    out = {
        "lm loss": stats.loss_sum / n,
        "learning-rate": lr,
        "consumed-samples": consumed,
        "throughput/step-time-ms": 1000 * step_s,
        "throughput/tokens-per-sec": tokens / step_s if step_s > 0 else 0.0,
        "throughput/tflops-per-gpu": flops_per_iter / step_s / args.derived.world_size / 1e12
        if step_s > 0 else 0.0,
        "memory/peak-bytes": peak_mem,
        "skipped-iterations": stats.skipped,
    }
    if stats.grad_norms:
        out["grad-norm"] = stats.grad_norms[-1]
    out.update({name: total / n for name, total in stats.aux_sums.items()})
    if traffic_known:
        out["attention/traffic-bytes-per-rank"] = stats.traffic_bytes // n
    return out


def log_line(iteration: int, args: TrainingConfig, m: dict) -> str:
    """``iteration N/ M | ... | lm loss: X.XXXXXXE+00 | ...`` as Megatron-LM prints it, plus ours."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    traffic = m.get("attention/traffic-bytes-per-rank")
    mem_kind = "GPU" if has_cuda() else "RSS"
    parts = [
        f" [{now}] iteration {iteration:8d}/{args.training.train_iters:8d}",
        f"consumed samples: {m['consumed-samples']:12d}",
        f"elapsed time per iteration (ms): {m['throughput/step-time-ms']:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {m['throughput/tflops-per-gpu']:.4g}",
        f"tokens/s: {m['throughput/tokens-per-sec']:.1f}",
        f"learning rate: {m['learning-rate']:.6E}",
        f"global batch size: {args.training.global_batch_size:5d}",
        f"lm loss: {m['lm loss']:.6E}",
    ]
    parts += [f"{name}: {m[name]:.6E}" for name in AUX_LOSS_NAMES.values() if name in m]
    if "grad-norm" in m:
        parts.append(f"grad norm: {m['grad-norm']:.3f}")
    parts += [
        "attention traffic per rank (MiB): "
        + ("n/a" if traffic is None else f"{traffic / 2**20:.3f}"),
        f"peak memory {mem_kind} (MiB): {m['memory/peak-bytes'] / 2**20:.1f}",
        f"number of skipped iterations: {m['skipped-iterations']:3d}",
    ]
    return " | ".join(parts) + " |"


def mesh_grid_label(args: TrainingConfig) -> str | None:
    """'AxRxC' ('RxC' with A = 1) of the grid the flag check decided; None without a mesh."""
    if not mesh_active(args):
        return None
    return shape_text(*args.mesh.mesh_shape)


def run_name(args: TrainingConfig, label: str | None) -> str | None:
    """--wandb-exp-name, else for a mesh run 'mesh-AxRxC-tpT-dpD' ('-ppP' before '-dp' with
    pipeline stages; None: wandb names it)."""
    if args.logging.wandb_exp_name or not label:
        return args.logging.wandb_exp_name
    pp = args.parallel.pipeline_model_parallel_size
    return (f"mesh-{label}-tp{args.parallel.tensor_model_parallel_size}-"
            f"{f'pp{pp}-' if pp > 1 else ''}dp{args.derived.data_parallel_size}")


class WandbLogger:
    """wandb on one rank when --wandb-project is given (WANDB_MODE=offline works as usual)."""

    def __init__(self, args: TrainingConfig, enabled: bool) -> None:
        self.run = None
        if not (enabled and args.logging.wandb_project):
            return
        import wandb

        config = {k: v for k, v in as_dict(args).items()
                  if isinstance(v, (int, float, str, bool, type(None), list, tuple))}
        label = mesh_grid_label(args)
        if label:
            config["mesh_grid"] = label
        self.run = wandb.init(project=args.logging.wandb_project, name=run_name(args, label),
                              dir=args.logging.wandb_save_dir, config=config)

    def log(self, metrics: dict, iteration: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=iteration)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


class Loggers:
    """Where a run's figures go besides stdout: wandb on rank 0, TensorBoard on the last rank."""

    def __init__(self, args: TrainingConfig, rank: int, world_size: int) -> None:
        from megatron_mesh.training.logs.tensorboard_log import TensorBoardLogger

        self.wandb = WandbLogger(args, enabled=rank == 0)
        self.tensorboard = TensorBoardLogger(args, enabled=rank == world_size - 1)

    def interval(self, metrics: dict, iteration: int) -> None:
        """The figures of a log line (every --log-interval)."""
        self.wandb.log(metrics, iteration)

    def iteration(self, metrics: dict, iteration: int, seconds: float) -> None:
        """One iteration's figures (TensorBoard, every --tensorboard-log-interval)."""
        self.tensorboard.iteration(metrics, iteration, seconds)

    def validation(self, loss: float, iteration: int, consumed_samples: int, split: str) -> None:
        """A validation or test pass's loss ('lm loss validation' / 'lm loss test')."""
        self.wandb.log({f"lm loss {split}": loss, f"lm loss {split} ppl": perplexity(loss)},
                       iteration)
        self.tensorboard.evaluation(loss, perplexity(loss), iteration, consumed_samples, split)

    def finish(self, exit_code: int) -> None:
        self.wandb.finish(exit_code)
        self.tensorboard.close()
