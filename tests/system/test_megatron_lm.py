"""Megatron-LM integration: the patch and the no-patch example against a real checkout.

Set MEGATRON_LM_DIR to a Megatron-LM checkout (tag core_v0.16.1, or core_v0.18 and later
for the no-patch example) whose Python environment can import megatron.training (it needs
triton, six, einops and regex, among others: the dev extra has them); skipped, saying so,
otherwise. scripts/test.sh sets it (core_v0.16.1, every test here) where the Megatron-LM
sources are at hand (scripts/megatron_lm_checkout.sh), scripts/test_mcore019.sh too
(core_v0.19.0, the example's tests). The checkout itself is never modified: the patch is
applied to an overlay of it. Megatron-LM's pretrain() asserts CUDA, so on a CPU the model
is built through Megatron-LM's own argument parsing and builders and trained for a step
here. core_v0.18+ declares Python >= 3.12; on 3.11 the subprocesses give `typing` the one
name it lacks, `override` (a marker decorator), from typing_extensions.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from preloaded import TINY, Job, job_env

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "scripts" / "apply_megatron_patch.sh"
EXAMPLE = REPO / "examples" / "megatron_lm_pretrain_mesh.py"
PATCHED = ("gpt_builders.py", "megatron/training/arguments.py", "megatron/training/initialize.py")

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_DIR,
    reason="no Megatron-LM checkout: MEGATRON_LM_DIR is not set (point it at one of core_v0.16.1; "
    "scripts/test.sh does where scripts/megatron_lm_checkout.sh finds the sources)",
)
_TYPING_BACKPORT = """
import sys, typing
if sys.version_info < (3, 12):
    import typing_extensions
    typing.override = typing_extensions.override
"""


def _core_version(path: Path) -> tuple[int, int]:
    """(major, minor) of the checkout's megatron/core/package_info.py."""
    text = (path / "megatron" / "core" / "package_info.py").read_text()
    fields = dict(line.split(" = ") for line in text.splitlines() if line[:6] in ("MAJOR ", "MINOR "))
    return int(fields["MAJOR"]), int(fields["MINOR"])


def _needs_patch_tag():
    if _core_version(_checkout()) != (0, 16):
        pytest.skip("the patch is for Megatron-LM core_v0.16.1; newer tags use the example")


def _checkout() -> Path:
    path = Path(MEGATRON_LM_DIR).resolve()
    assert (path / "pretrain_gpt.py").is_file(), f"{path} is not a Megatron-LM checkout"
    return path


def _overlay(src: Path, dst: Path) -> Path:
    """dst mirrors src through symlinks, except real copies of the files the patch edits."""
    copies = {Path(p) for p in PATCHED}
    parents = {parent for p in copies for parent in p.parents if str(parent) != "."}

    def mirror(rel: Path) -> None:
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for entry in (src / rel).iterdir():
            child = rel / entry.name
            if child in copies:
                shutil.copy2(entry, dst / child)
            elif child in parents:
                mirror(child)
            else:
                (dst / child).symlink_to(entry)

    mirror(Path())
    return dst


def _python(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGATRON_LM_DIR=str(cwd), CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(cwd), str(REPO), env.get("PYTHONPATH", "")) if p
    )
    code = _TYPING_BACKPORT + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_patch_applies_to_the_checkout():
    _needs_patch_tag()
    proc = subprocess.run(["bash", str(APPLY), "--check", str(_checkout())],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "applies cleanly" in proc.stdout or "already applied" in proc.stdout


def test_apply_script_rejects_a_directory_that_is_not_megatron_lm(tmp_path):
    proc = subprocess.run(["bash", str(APPLY), "--check", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not a Megatron-LM checkout" in proc.stderr


def test_patched_megatron_lm_parses_and_checks_the_mesh_flags(tmp_path):
    _needs_patch_tag()
    overlay = _overlay(_checkout(), tmp_path / "Megatron-LM")
    proc = subprocess.run(["bash", str(APPLY), str(overlay)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run(["bash", str(APPLY), "--check", str(overlay)], capture_output=True,
                          text=True, timeout=60)
    assert "already applied" in proc.stdout, proc.stdout + proc.stderr

    proc = _python(
        """
        import os, sys
        import torch
        import megatron.training.arguments as arguments
        if not torch.cuda.is_available():
            # validate_args asks the GPU generation when CP > 1; answer for CPU-only hosts.
            arguments.get_device_arch_version = lambda: 9
        os.environ["WORLD_SIZE"] = "8"
        base = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
                "--num-attention-heads", "4", "--seq-length", "256",
                "--max-position-embeddings", "256", "--micro-batch-size", "1",
                "--global-batch-size", "2", "--context-parallel-size", "4", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
                "--attention-dropout", "0"]

        def parse(*extra):
            sys.argv = base + list(extra)
            args = arguments.parse_args()
            arguments.validate_args(args)
            return args

        args = parse("--context-parallel-algo", "mesh", "--mesh-shape", "2x2")
        print("MESH", args.context_parallel_algo, args.mesh_shape)
        print("AUTO", parse("--context-parallel-algo", "mesh").mesh_shape)
        print("HEADS", parse("--context-parallel-algo", "mesh", "--mesh-heads", "2").mesh_shape)
        print("GRID", parse("--cp-comm-type", "mesh", "--mesh-shape", "2x1x2").mesh_shape)
        print("A2A", parse("--context-parallel-algo", "a2a").cp_comm_type)
        print("KEEP", parse("--cp-comm-type", "all_gather").cp_comm_type)
        comm = parse("--cp-comm-type", "mesh", "--mesh-shape", "2x2")
        print("COMM", comm.context_parallel_algo, comm.mesh_shape)
        try:
            parse("--context-parallel-algo", "mesh", "--mesh-shape", "3x2")
        except ValueError as error:
            print("BAD", error)
        """,
        overlay,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    assert "MESH mesh (1, 2, 2)" in out
    assert "AUTO (" in out
    assert "HEADS (2, " in out and "GRID (2, 1, 2)" in out
    assert "A2A ['a2a']" in out
    assert "KEEP ['all_gather']" in out
    assert "COMM mesh (1, 2, 2)" in out
    assert "BAD" in out and "3x2" in out


def test_patched_megatron_lm_builds_chunked_layers_and_a_builder_s_mask(tmp_path):
    """The patched Megatron-LM parses --attention-chunk-size with its own --no-rope-freq and
    its gpt_builder makes layer 1 chunked (RoPE) and layer 2 global (no RoPE); with
    --mesh-mask-builder the model takes the builder's prefix-LM mask on every forward: the
    loss equals the same weights given that mask as packed_seq_params, and differs from
    causal attention."""
    _needs_patch_tag()
    overlay = _overlay(_checkout(), tmp_path / "Megatron-LM")
    proc = subprocess.run(["bash", str(APPLY), str(overlay)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _python(
        """
        import os, sys
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import initialize_rng_tracker
        from megatron.training import arguments, global_vars
        from gpt_builders import gpt_builder
        import megatron_mesh as mm
        from megatron_mesh.megatron.cpu import megatron_on_cpu
        from megatron_mesh.megatron.mask_builder import masked_seq_params

        os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29519")
        base = ["pretrain_gpt.py", *%r, "--context-parallel-algo", "mesh"]

        def parse(*extra):
            sys.argv = base + list(extra)
            args = arguments.parse_args()
            arguments.validate_args(args)
            return args

        args = parse("--attention-chunk-size", "8", "--no-rope-freq", "2")
        global_vars.set_global_variables(args, build_tokenizer=True)
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()

        def build(later):
            later.padded_vocab_size = args.padded_vocab_size  # set by the tokenizer's build
            torch.manual_seed(1234)
            initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            return gpt_builder(later, True, True)

        with megatron_on_cpu():
            model = build(args)
            cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
            print("CHUNKS", [c.chunk for c in cores], model.config.no_rope_freq)
            tokens = torch.randint(0, 255, (2, 65), generator=torch.Generator().manual_seed(0))
            positions = torch.arange(64).expand(2, 64)
            losses = {}
            for name, extra in (("builder", ["--mesh-mask-builder",
                                             "examples.mask_builders:prefix_lm"]),
                                ("plain", [])):
                model = build(parse(*extra))
                losses[name] = model(tokens[:, :-1], positions, None,
                                     labels=tokens[:, 1:]).mean().item()
                if name == "plain":
                    given = masked_seq_params(mm.prefix_lm_mask(64, 16))
                    losses["given"] = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:],
                                            packed_seq_params=given).mean().item()
            print("SAME", abs(losses["builder"] - losses["given"]) < 1e-6,
                  abs(losses["builder"] - losses["plain"]) > 1e-4)
        try:
            parse("--attention-chunk-size", "8", "--window-size", "4,0")
        except ValueError as error:
            print("BAD", error)
        """ % TINY_IN_MEGATRON_LM,
        overlay,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    assert "CHUNKS [8, None] [0, 1]" in out
    assert "SAME True True" in out
    assert "BAD --attention-chunk-size 8 with --window-size: give one mask" in out


def test_no_patch_example_imports_and_adds_the_flags():
    checkout = _checkout()
    proc = _python(
        f"""
        import argparse, importlib.util
        spec = importlib.util.spec_from_file_location("example", {str(EXAMPLE)!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        for name in ("extra_args_provider", "mesh_model_provider", "mesh_gpt_builder", "main"):
            assert callable(getattr(example, name)), name
        parser = example.extra_args_provider(argparse.ArgumentParser())
        args = parser.parse_args(["--context-parallel-algo", "mesh", "--mesh-shape", "2x4"])
        print("ARGS", args.context_parallel_algo, args.mesh_shape)
        print("CONFIG_API", example.gpt_config_from_args is not None)
        """,
        checkout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "ARGS mesh (2, 4)" in proc.stdout
    assert f"CONFIG_API {_core_version(checkout) >= (0, 18)}" in proc.stdout


def test_no_patch_example_trains_the_mesh_model_like_megatron_lm_s_own():
    """Megatron-LM parses the flags (--cp-comm-type mesh through the example's
    extra_args_provider) and builds the GPT with its own builder twice: through the example
    (mesh core attention) and as it would itself (local spec). Same seed, same weights:
    one training step gives the same loss and gradients."""
    checkout = _checkout()
    proc = _python(
        f"""
        import importlib.util, os, sys
        import torch
        import torch.distributed as dist
        from megatron_mesh.megatron.cpu import megatron_on_cpu
        spec = importlib.util.spec_from_file_location("example", {str(EXAMPLE)!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import initialize_rng_tracker
        from megatron.training import arguments, global_vars

        os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
        sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
                    "--num-attention-heads", "4", "--seq-length", "64",
                    "--max-position-embeddings", "64", "--micro-batch-size", "2",
                    "--global-batch-size", "2", "--mock-data", "--tokenizer-type",
                    "NullTokenizer", "--vocab-size", "255", "--attention-dropout", "0",
                    "--hidden-dropout", "0", "--transformer-impl", "local",
                    "--position-embedding-type", "rope", "--no-rope-fusion",
                    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
                    "--distributed-backend", "gloo", "--cp-comm-type", "mesh"]
        if example.gpt_config_from_args is not None:
            args = example.parse_and_validate_args(extra_args_provider=example.extra_args_provider,
                                                   args_defaults=example.ARGS_DEFAULTS)
        else:
            args = arguments.parse_args(extra_args_provider=example.extra_args_provider)
            arguments.validate_args(args, example.ARGS_DEFAULTS)
            global_vars.set_global_variables(args, build_tokenizer=True)
        example.validate_mesh_args(args)  # as main() does before pretrain()
        print("ALGO", args.context_parallel_algo, args.cp_comm_type)
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()

        def build(mesh):
            torch.manual_seed(1234)
            initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # CPU: one RNG
            args.context_parallel_algo = "mesh" if mesh else "p2p"
            if example.gpt_config_from_args is None:
                return (example.mesh_gpt_builder if mesh else example.gpt_builder)(args, True, True)
            from megatron.core.process_groups_config import ProcessGroupCollection
            from megatron.training.models.gpt import GPTModelBuilder
            config = example.mesh_model_config(args)
            pgs = ProcessGroupCollection.use_mpu_process_groups()
            return GPTModelBuilder(config).build_model(pgs, pre_process=True, post_process=True)

        with megatron_on_cpu():
            tokens = torch.randint(0, 255, (2, 65), generator=torch.Generator().manual_seed(0))
            positions = torch.arange(64).expand(2, 64)
            results = []
            for mesh in (False, True):
                model = build(mesh)
                core = model.decoder.layers[0].self_attention.core_attention
                loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
                loss.backward()
                grads = [p.grad.clone() for p in model.parameters()]
                results.append((loss.item(), grads))
                print("CORE", mesh, type(core).__name__, "loss %.6f" % loss.item())
            (ref, ref_grads), (got, got_grads) = results
            print("SAME", abs(ref - got) < 1e-6 and len(ref_grads) == len(got_grads) and all(
                torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ref_grads, got_grads)))
        """,
        checkout,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    print(out)
    assert "ALGO mesh ['mesh']" in out
    assert "CORE False DotProductAttention" in out
    assert "CORE True MeshDotProductAttention" in out
    assert "SAME True" in out


def test_no_patch_example_attaches_a_builder_in_the_forward_step():
    """On core_v0.18+ the model comes from a config and no provider sees it: the example's
    forward step attaches --mesh-mask-builder's builder to the GPTModel (once). The loss
    through it equals the same weights given the builder's prefix-LM mask as
    packed_seq_params, and differs from causal attention."""
    checkout = _checkout()
    if _core_version(checkout) < (0, 18):
        pytest.skip("core_v0.16.1's example attaches the builder in its model provider")
    proc = _python(
        f"""
        import importlib.util, os, sys
        import torch
        import torch.distributed as dist
        import megatron_mesh as mm
        from megatron_mesh.megatron.cpu import megatron_on_cpu
        from megatron_mesh.megatron.mask_builder import masked_seq_params
        spec = importlib.util.spec_from_file_location("example", {str(EXAMPLE)!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel.random import initialize_rng_tracker
        from megatron.training.models.gpt import GPTModelBuilder

        os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29523")
        sys.argv = ["pretrain_gpt.py", *{TINY_IN_MEGATRON_LM!r}, "--cp-comm-type", "mesh",
                    "--mesh-mask-builder", "examples.mask_builders:prefix_lm"]
        args = example.parse_and_validate_args(extra_args_provider=example.extra_args_provider,
                                               args_defaults=example.ARGS_DEFAULTS)
        example.validate_mesh_args(args)
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        tokens = torch.randint(0, 255, (2, 65), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(64).expand(2, 64)

        def step(data_iterator, model):  # Megatron-LM's forward_step, without its data
            batch = next(data_iterator)
            return model(batch[:, :-1], positions, None, labels=batch[:, 1:]).mean().item()

        example.pretrain_gpt.forward_step = step
        example.get_args = lambda: args
        with megatron_on_cpu():
            torch.manual_seed(1234)
            initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            model = GPTModelBuilder(example.mesh_model_config(args)).build_model(
                ProcessGroupCollection.use_mpu_process_groups(), pre_process=True,
                post_process=True)
            plain = step(iter([tokens]), model)
            given = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:],
                          packed_seq_params=masked_seq_params(mm.prefix_lm_mask(64, 16))
                          ).mean().item()
            built = [example.mesh_forward_step(iter([tokens]), model) for _ in range(2)]
            print("HOOKS", len(model._forward_pre_hooks))
            print("SAME", all(abs(b - given) < 1e-6 for b in built), abs(given - plain) > 1e-4)
        """,
        checkout,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    assert "HOOKS 1" in out and "SAME True True" in out, out


# the tiny driver model in Megatron-LM's flags; the MLP width is left to both sides' SwiGLU
# default (8h / 3 rounded down to a multiple of 64), which must agree
TINY_IN_MEGATRON_LM = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--tokenizer-type",
    "NullTokenizer", "--vocab-size", "255", "--make-vocab-size-divisible-by", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
    "--transformer-impl", "local", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--distributed-backend", "gloo", "--attention-dropout", "0", "--hidden-dropout", "0"]


def test_megatron_lm_loads_the_driver_s_checkpoint(tmp_path):
    """The driver saves iteration 4 (torch_dist, checksums.json beside); Megatron-LM's own
    load_checkpoint (--ckpt-format torch_dist --no-load-optim --no-load-rng) reads it into
    the GPT its gpt_builder makes from the same sizes: iteration 4, and every weight equal to
    the saved tensor."""
    _needs_patch_tag()  # core_v0.16.1's gpt_builders.gpt_builder builds the model
    checkout = _checkout()
    save = tmp_path / "save"
    run = Job(["--config", TINY, "--train-iters", "4", "--save", str(save)],
              job_env()).wait(timeout=240)
    assert run.returncode == 0, run.output[-3000:]
    assert (save / "iter_0000004" / "checksums.json").is_file()
    flags = [*TINY_IN_MEGATRON_LM, "--load", str(save), "--ckpt-format", "torch_dist",
             "--no-load-optim", "--no-load-rng"]
    proc = _python(
        f"""
        import os, sys
        import torch
        import torch.distributed as dist
        from megatron_mesh.megatron.cpu import megatron_on_cpu
        from megatron_mesh.runtime.spawn import free_port
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.tensor_parallel.random import initialize_rng_tracker
        from megatron.training import arguments, global_vars
        from megatron.training.checkpointing import load_checkpoint
        from gpt_builders import gpt_builder

        os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        sys.argv = ["pretrain_gpt.py", *{flags!r}]
        args = arguments.parse_args()
        arguments.validate_args(args)
        global_vars.set_global_variables(args, build_tokenizer=True)
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        with megatron_on_cpu():
            torch.manual_seed(0)
            initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            model = gpt_builder(args, True, True)
            iteration, _ = load_checkpoint([model], None, None, strict=True)
            print("ITERATION", iteration)
            saved = dist_checkpointing.load_plain_tensors({str(save / "iter_0000004")!r})
            same, other = 0, []
            for t in nested_values(model.sharded_state_dict()):
                if not isinstance(t, ShardedTensor):
                    continue
                n = t.prepend_axis_num  # the layer index of a stacked layer's tensor
                index = tuple(t.global_offset[:n]) + tuple(
                    slice(o, o + s) for o, s in zip(t.global_offset[n:], t.data.shape))
                if t.key in saved and torch.equal(saved[t.key][index], t.data):
                    same += 1
                else:
                    other.append(t.key)
            print("WEIGHTS", same, "equal; not equal or missing:", other)
        """,
        checkout,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-4000:]
    assert f"successfully loaded checkpoint from {save}" in out and "ITERATION 4" in out, out
    assert "checkpoint version 3.0" in out, out
    assert "WEIGHTS 12 equal; not equal or missing: []" in out, out
