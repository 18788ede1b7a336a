"""Cost of certified training (--loss certified) against plain training, per step and per epoch.

    python benchmarks/bench_train.py [--preset paper-d3 | --checkpoint PATH] [--batch-size 256]
        [--steps 20] [--power-iterations 2] [--device auto] [--out bench_train.json]
        [--profile profile.txt] [--compile default|reduce-overhead|max-autotune|cudagraphs ...]
        [--no-amp] [--cpu-amp] [--float32-matmul highest|high|medium] [--stack-blocks auto|on|off]

Times full optimisation steps (forward, loss, backward, AdamW) on random CIFAR-sized images, after
warm-up steps, and extrapolates to one epoch of 50,000 images. Prints a table and writes JSON;
--profile also runs five certified steps under torch.profiler and writes the operators that
took the most time (device time on a GPU) to the named file; --compile adds rows for the plain
and the certified step under torch.compile in that mode
(``lofast.training.objective.CompiledObjective``, as `lofast train --compile`; compilation in
the warm-up steps, untimed; cudagraphs: CUDA graphs of the captured step without Inductor's
generated kernels) and their ratio. --float32-matmul sets
``torch.set_float32_matmul_precision`` for every row: "high" lets float32 products (the
training bound's, which autocast leaves in float32) run in TF32 on a GPU, "medium" in
bfloat16; the training bound is an estimate, not a certificate, so its precision is a speed
question (the default "highest" is what `lofast train` runs).
Each eager row also counts the operators that launch work in one forward and backward pass
(views and other metadata-only operators left out; the optimizer's few fused kernels too): on
a GPU a step of these small tensors waits for the host to launch them, so the count predicts
the GPU's time per step where no GPU is at hand (on a CPU with --stack-blocks on: the training
bound then stacks its blocks as on a GPU).
A fresh model has live attention; a trained certified one (--checkpoint) has nearly uniform
attention, where the training bound, like the certifier, skips the refinement's power steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from measure import LaunchCounter, output_file, profile_table, sync  # beside this script

from lofast.checkpoint import checkpoint_path, load_checkpoint
from lofast.config import TrainConfig, preset
from lofast.models.vit import LipschitzViT, create_model
from lofast.runtime import device_name, resolve_device
from lofast.training.bound import TrainingBound
from lofast.training.loop import autocast_enabled, training_step
from lofast.training.objective import CompiledObjective, TrainingObjective

EPOCH_IMAGES = 50_000

def seconds_per_step(config: TrainConfig, initial: LipschitzViT, device: torch.device,
                     steps: int, warmup: int = 3, profile: str | None = None,
                     compile_mode: str | None = None,
                     stack: bool | None = None) -> tuple[float, int | None]:
    """Seconds per optimisation step, and the operators launched by one forward and backward
    pass (None under torch.compile, whose kernels bypass the dispatcher); stack: the training
    bound's ``TrainingBound.stack`` (None: its default for the device)."""
    model = copy.deepcopy(initial).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(config.batch_size, 3, 32, 32, generator=generator).to(device)
    y = torch.randint(0, 10, (config.batch_size,), generator=generator).to(device)
    bound = (TrainingBound(config.power_iterations, softmax_jacobian=config.softmax_jacobian)
             if config.loss == "certified" else None)
    if bound is not None:
        bound.stack = stack
    objective = TrainingObjective(model, config, bound)
    if compile_mode is not None:
        objective = CompiledObjective(objective, compile_mode)
    use_amp = autocast_enabled(config, device)
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            sync(device)
            started = time.perf_counter()
        training_step(objective, optimizer, x, y, config.train_eps, use_amp)
    sync(device)
    seconds = (time.perf_counter() - started) / steps
    if profile is not None:
        write_profile(profile, device, lambda: training_step(objective, optimizer, x, y,
                                                             config.train_eps, use_amp))
    launches = None
    if compile_mode is None:
        with LaunchCounter() as counter:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                loss, _ = objective(x, y, config.train_eps)
            loss.backward()
        optimizer.zero_grad(set_to_none=True)
        launches = counter.count
    return seconds, launches


def write_profile(path: str, device: torch.device, step, steps: int = 5) -> None:
    """Five steps under torch.profiler; the 40 operators with the most self time to `path`."""
    table, sort = profile_table(device, step, repeats=steps)
    with open(path, "w") as f:
        f.write(f"{steps} certified steps, sorted by {sort}\n{table}\n")
    print("\n".join(table.splitlines()[:18]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper-d3")
    parser.add_argument("--checkpoint", help="time this trained model instead of a fresh preset")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--power-iterations", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=output_file, default="bench_train.json")
    parser.add_argument("--profile", help="write a torch.profiler table of certified steps here")
    parser.add_argument("--no-amp", dest="amp", action="store_false",
                        help="float32 on a GPU too (as `lofast train --no-amp`; by default the "
                             "model's forward and backward run in bfloat16 autocast there, the "
                             "bound in float32 always)")
    parser.add_argument("--cpu-amp", action="store_true",
                        help="bfloat16 autocast on a CPU too (as `lofast train --cpu-amp`)")
    parser.add_argument("--stack-blocks", choices=["auto", "on", "off"], default="auto",
                        help="the training bound's attention blocks estimated together (on: as "
                             "on an accelerator, whose launches a CPU run then counts) or a "
                             "block at a time (off: as on a CPU); auto: the device's way")
    parser.add_argument("--compile", choices=["default", "reduce-overhead", "max-autotune",
                                              "cudagraphs"], action="append", default=[],
                        help="also time the plain and certified steps under torch.compile "
                             "in this mode (repeatable)")
    parser.add_argument("--float32-matmul", choices=["highest", "high", "medium"],
                        default="highest", help="torch.set_float32_matmul_precision for the "
                        "run (high: TF32 on a GPU)")
    args = parser.parse_args()

    torch.set_float32_matmul_precision(args.float32_matmul)
    device = resolve_device(args.device)
    initial = (load_checkpoint(checkpoint_path(args.checkpoint)) if args.checkpoint
               else create_model(preset(args.preset), seed=0))
    precision = {"amp": args.amp, "cpu_amp": args.cpu_amp}
    configs = {
        "ce": TrainConfig(batch_size=args.batch_size, **precision),
        "certified": TrainConfig(batch_size=args.batch_size, loss="certified", train_eps=0.2,
                                 power_iterations=args.power_iterations, **precision),
        "certified, no refinement": TrainConfig(
            batch_size=args.batch_size, loss="certified", train_eps=0.2,
            power_iterations=args.power_iterations, softmax_jacobian=False, **precision),
    }
    for mode in args.compile:
        configs[f"ce, compiled ({mode})"] = configs["ce"]
        configs[f"certified, compiled ({mode})"] = configs["certified"]
    rows = {}
    for name, config in configs.items():
        step, launches = seconds_per_step(
            config, initial, device, args.steps,
            profile=args.profile if name == "certified" else None,
            compile_mode=name.split("(")[1][:-1] if "compiled" in name else None,
            stack={"auto": None, "on": True, "off": False}[args.stack_blocks])
        rows[name] = {"ms_per_step": 1e3 * step,
                      "images_per_second": args.batch_size / step,
                      "seconds_per_epoch": step * EPOCH_IMAGES / args.batch_size,
                      "launches_per_step": launches}
        print(f"{name:26s} {1e3 * step:8.1f} ms/step  {args.batch_size / step:8.0f} img/s  "
              f"{rows[name]['seconds_per_epoch']:7.1f} s/epoch  {launches or '-':>6} launches",
              flush=True)
    ratio = rows["certified"]["ms_per_step"] / rows["ce"]["ms_per_step"]
    unrefined = rows["certified, no refinement"]["ms_per_step"] / rows["ce"]["ms_per_step"]
    print(f"certified / plain: {ratio:.2f}x (without the refinement: {unrefined:.2f}x)")
    compiled_ratios = {mode: rows[f"certified, compiled ({mode})"]["ms_per_step"]
                       / rows[f"ce, compiled ({mode})"]["ms_per_step"] for mode in args.compile}
    for mode, compiled_ratio in compiled_ratios.items():
        print(f"certified / plain, both compiled ({mode}): {compiled_ratio:.2f}x")
    report = {"device": str(device), "processor": device_name(device),
              "threads": torch.get_num_threads(), "preset": args.preset,
              "checkpoint": args.checkpoint,
              "batch_size": args.batch_size, "power_iterations": args.power_iterations,
              "bfloat16_autocast": autocast_enabled(configs["ce"], device),
              "float32_matmul": args.float32_matmul, "stack_blocks": args.stack_blocks,
              "rows": rows, "certified_over_plain": ratio,
              "unrefined_over_plain": unrefined,
              "compiled_certified_over_plain": compiled_ratios}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
