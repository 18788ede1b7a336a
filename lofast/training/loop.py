"""Training loop, data augmentation and the resumable training state (the loss of a step:
``lofast.training.objective``). Progress goes through callbacks."""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lofast.config import Loss, ModelConfig, Schedule, TrainConfig, plain_dict
from lofast.errors import LofastError, TimeLimitReached, TrainingInterrupted
from lofast.files import atomic_write, check_readable
from lofast.models.vit import LipschitzViT
from lofast.training.bound import TrainingBound
from lofast.training.objective import CompiledObjective, TrainingObjective, scheduled_eps


def augment(images: Tensor, generator: torch.Generator) -> Tensor:
    """Random crop with 4-pixel zero padding and random horizontal flip, (B, C, H, W), drawn
    from ``generator``, a generator of the images' device: nothing goes through the host."""
    b, _, h, w = images.shape
    device = images.device
    padded = F.pad(images, (4, 4, 4, 4))
    shift = torch.randint(0, 9, (2, b), generator=generator, device=device)  # rows, columns
    rows = shift[0, :, None] + torch.arange(h, device=device)  # (B, H)
    cols = shift[1, :, None] + torch.arange(w, device=device)  # (B, W)
    batch = torch.arange(b, device=device)[:, None, None, None]
    channel = torch.arange(images.shape[1], device=device)[None, :, None, None]
    out = padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]
    flip = torch.rand(b, generator=generator, device=device) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(-1), out)


def to_float(images: np.ndarray | Tensor, device: torch.device) -> Tensor:
    """uint8 (B, H, W, C) -> float32 (B, C, H, W) in [0, 1] on device."""
    t = torch.as_tensor(images).to(device)
    return t.permute(0, 3, 1, 2).float().div_(255.0)


@torch.no_grad()
def evaluate(model: LipschitzViT, images: np.ndarray, labels: np.ndarray,
             device: torch.device, batch_size: int = 500) -> float:
    """Clean accuracy in [0, 1]. The exact caps (an SVD per capped weight) are computed once,
    not once per batch, and the correct predictions summed on the device."""
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    with model.reusing_effective_weights():
        for start in range(0, len(labels), batch_size):
            x = to_float(images[start:start + batch_size], device)
            y = torch.as_tensor(labels[start:start + batch_size], device=device)
            correct += (model(x).argmax(dim=1) == y).sum()
    return int(correct) / max(len(labels), 1)


@dataclass
class EpochStats:
    epoch: int
    epochs: int
    train_loss: float
    train_accuracy: float
    test_accuracy: float
    images_per_second: float
    seconds: float


@dataclass
class StepStats:
    epoch: int
    step: int
    steps: int
    loss: float
    accuracy: float
    images_per_second: float


# Steps between host synchronisations of the training loop (loss, accuracy, divergence, the
# progress shown); also at the first and last step of an epoch.
SYNC_STEPS = 10


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def autocast_enabled(config: TrainConfig, device: torch.device) -> bool:
    """Whether the model's forward and backward run in bfloat16 autocast (the training bound
    stays float32): with amp on CUDA devices, and with cpu_amp on CPUs too."""
    return config.amp and (device.type == "cuda" or (device.type == "cpu" and config.cpu_amp))


def training_step(objective: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
                  eps: float, use_amp: bool) -> tuple[Tensor, Tensor]:
    """One optimisation step on a batch (B, C, H, W); returns the loss (detached, on the
    device) and the clean logits. No host synchronisation: the caller checks the loss for
    divergence every SYNC_STEPS steps (a non-finite loss leaves non-finite weights behind)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=use_amp):
        loss, logits = objective(x, y, eps)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach(), logits


def _lr_factor(step: int, total: int, warmup: int, schedule: Schedule) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if schedule is Schedule.CONSTANT:
        return 1.0
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def train(model: LipschitzViT, train_images: np.ndarray, train_labels: np.ndarray,
          test_images: np.ndarray, test_labels: np.ndarray, config: TrainConfig,
          device: torch.device, state_path: Path | None = None, resume: bool = False,
          plan: dict | None = None, on_step: Callable[[StepStats], None] | None = None,
          on_epoch: Callable[[EpochStats], None] | None = None,
          deadline: float | None = None, signals: StopSignals | None = None,
          compile_mode: str | None = None) -> list[EpochStats]:
    """Train in place; after every epoch the full state is written atomically to state_path.

    With a deadline (a time.monotonic() value), training stops at the first step boundary
    after it, writes the state there (mid-epoch included) and raises TimeLimitReached; a
    resume continues from that step exactly as if nothing had stopped it. A signal kept by the
    caller's ``signals`` (a ``StopSignals`` it entered) does the same and raises
    TrainingInterrupted.

    With resume=True and an existing state file, training continues after the last finished
    epoch with the same optimizer, schedule and random streams, so an interrupted run ends
    where an uninterrupted one would. `plan` (JSON values) names what else the run depends on
    (model config, data digest...): it is saved with the state, and a resume with another plan
    or other settings is refused.

    compile_mode: train with the step compiled (``CompiledObjective``), in one process only.
    The function is the same, so a run may resume compiled or not.
    """
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(len(train_labels) / config.batch_size)
    total = steps_per_epoch * config.epochs
    warmup = int(config.warmup_epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: _lr_factor(s, total, warmup, config.schedule))
    generator = torch.Generator().manual_seed(config.seed)
    # the augmentation's draws, on the device (the others are few, or feed the host's order)
    augment_generator = torch.Generator(device).manual_seed(config.seed)
    history: list[EpochStats] = []
    start_epoch = 0
    state = None
    partial = None  # where a run stopped inside an epoch: its order, next step and sums
    if resume and state_path is not None and state_path.is_file():
        state = load_training_state(state_path)
        # a setting added since the state was written takes its default, which is how the
        # state was trained (every new TrainConfig field defaults to the former behaviour)
        saved_config = {**plain_dict(TrainConfig()), **state["train_config"]}
        if saved_config != plain_dict(config):
            raise LofastError(f"{state_path}: the training settings differ from this run's; "
                              "resume with the same options")
        saved_plan = dict(state.get("plan") or {})
        try:  # likewise a model field added since: its default is the model the state trained
            saved_plan["model_config"] = ModelConfig.from_dict(
                json.loads(saved_plan["model_config"])).to_json()
        except (KeyError, TypeError, ValueError, RecursionError, LofastError):
            pass  # absent or unreadable: compared as written, so such a state is refused below
        changed = sorted(k for k in set(saved_plan) | set(plan or {})
                         if saved_plan.get(k) != (plan or {}).get(k))
        if saved_plan and plan and changed:
            raise LofastError(f"{state_path}: this run differs from the one it would resume in "
                              f"{', '.join(changed)}; resume with the same model, data and "
                              "options, or choose another --out")
        try:
            model.load_state_dict(state["model"])
        except RuntimeError:  # a state written before plans were saved, for another model
            raise LofastError(f"{state_path}: saved for another model; resume with the same "
                              "model, or choose another --out") from None
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        generator.set_state(state["generator"])
        try:
            augment_generator.set_state(state["augment_generator"])
        except (KeyError, RuntimeError):
            # a state of an older version, or saved on another kind of device (whose generator
            # state has another form): the augmentation goes on from the seed, and the run is
            # no longer bit for bit the uninterrupted one
            pass
        start_epoch = state["epoch"]
        history = [EpochStats(**h) for h in state["history"]]
        partial = state.get("partial")
    bound = TrainingBound(config.power_iterations, softmax_jacobian=config.softmax_jacobian,
                          generator=generator) \
        if config.loss is Loss.CERTIFIED else None
    if bound is not None and state is not None:
        bound.load_state(state.get("bound", {}), device)
    objective: nn.Module = TrainingObjective(model, config, bound)
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    if world > 1:
        if config.batch_size % world:
            raise LofastError(f"batch size {config.batch_size} is not divisible by the "
                              f"{world} processes")
        # averages the gradients of the processes' parts of every batch; starts from rank 0's
        # weights (equal anyway: all processes load the same initial model or state)
        objective = nn.parallel.DistributedDataParallel(objective)
    if compile_mode is not None:
        if world > 1:
            raise LofastError("a compiled training step runs in one process; drop --compile "
                              "under torchrun")
        objective = CompiledObjective(objective, compile_mode)
    use_amp = autocast_enabled(config, device)
    # the whole uint8 training set lives on the device; batches are gathered there
    images_all = torch.as_tensor(train_images).to(device)
    labels_all = torch.as_tensor(train_labels).to(device)
    for epoch in range(start_epoch, config.epochs):
        model.train()
        if partial is None:
            order = torch.randperm(len(train_labels), generator=generator)
            first_step, loss_sum, correct, seen, before = 0, 0.0, 0, 0, 0.0
        else:
            order, first_step = partial["order"], partial["step"]
            # the sums of the steps before the stop, over every process of the stopped run: rank
            # 0 carries them on, so that they count once whatever the number of processes now
            loss_sum, correct, seen = ((partial["loss_sum"], partial["correct"], partial["seen"])
                                       if rank == 0 else (0.0, 0, 0))
            before, partial = partial["seconds"], None
        # this process's loss and correct predictions summed on the device, read every
        # SYNC_STEPS steps: a host synchronisation per step would stall a GPU
        sums = torch.tensor([loss_sum, correct], dtype=torch.float64, device=device)
        started = time.perf_counter() - before
        # on the device once per epoch: a batch's indices copied in from the host would wait
        # for the work queued on the device, at every step
        order_on_device = order.to(device)
        for step in range(first_step, steps_per_epoch):
            # one global batch per step whatever the number of processes; each takes every
            # world-th sample of it (so a resume may change the number of processes)
            index = order_on_device[step * config.batch_size:
                                    (step + 1) * config.batch_size][rank::world]
            x = images_all[index].permute(0, 3, 1, 2).float().div_(255.0)
            y = labels_all[index]
            if config.augment:
                x = augment(x, augment_generator)
            eps = scheduled_eps(config, epoch + step / steps_per_epoch)
            try:
                loss, logits = training_step(objective, optimizer, x, y, eps, use_amp)
            except (torch.linalg.LinAlgError, ValueError):
                # weights gone non-finite since the last loss check, refused by a check or a
                # solver inside the step (today's step has none: they show in the loss)
                if _finite_weights(model):
                    raise
                raise LofastError(f"training diverged at epoch {epoch + 1} (non-finite weights); "
                                  "lower the learning rate") from None
            except RuntimeError as e:  # dynamo's errors too
                if compile_mode is None:
                    raise
                # a compilation or capture that failed, in the forward or the backward graph
                # (on an H200, cuSOLVER inside a CUDA graph did): one line, not a traceback
                what = (str(e).strip().splitlines() or [""])[0][:200]
                raise LofastError(f"the compiled training step failed ({type(e).__name__}: "
                                  f"{what}); train without --compile (--resume goes on from "
                                  "the last saved state)") from e
            scheduler.step()
            sums += torch.stack([loss.double() * len(y),
                                 (logits.argmax(dim=1) == y).sum().double()])
            seen += len(y)
            stop = _stop_requested(deadline, signals) if step + 1 < steps_per_epoch else 0
            stopping = stop != 0
            if (stopping or step == first_step or (step + 1) % SYNC_STEPS == 0
                    or step + 1 == steps_per_epoch):
                loss_sum, correct = _checked_sums(sums, epoch)
                if on_step is not None:
                    on_step(StepStats(epoch + 1, step + 1, steps_per_epoch, loss_sum / seen,
                                      correct / seen,
                                      world * seen / (time.perf_counter() - started)))
            if stopping:
                total_loss, total_correct, total_seen = _summed(loss_sum, correct, seen, device)
                stopped = {"order": order, "step": step + 1, "loss_sum": total_loss,
                           "correct": total_correct, "seen": total_seen,
                           "seconds": time.perf_counter() - started}
                if state_path is not None and rank == 0:
                    save_training_state(state_path, model, optimizer, scheduler,
                                        (generator, augment_generator), epoch, config,
                                        history, bound, plan, stopped)
                raise _stopped(stop, f"epoch {epoch + 1}, step {step + 1}/{steps_per_epoch}",
                               history)
        seconds = time.perf_counter() - started
        loss_sum, correct, seen = _summed(loss_sum, correct, seen, device)
        test_accuracy = evaluate(model, test_images, test_labels, device) if rank == 0 else 0.0
        stats = EpochStats(epoch + 1, config.epochs, loss_sum / seen, correct / seen,
                           test_accuracy, seen / seconds, seconds)
        if not _finite_weights(model):
            raise LofastError(f"training produced non-finite weights in epoch {epoch + 1}; the "
                              "last finished epoch's state is kept; lower the learning rate")
        history.append(stats)
        if state_path is not None and rank == 0:
            save_training_state(state_path, model, optimizer, scheduler,
                                (generator, augment_generator), epoch + 1, config, history,
                                bound, plan)
        if on_epoch is not None:
            on_epoch(stats)
        stop = _stop_requested(deadline, signals)
        if stop and epoch + 1 < config.epochs:
            raise _stopped(stop, f"epoch {epoch + 1} of {config.epochs}", history)
    model.eval()
    return history


def _finite_weights(model: nn.Module) -> bool:
    """Whether every parameter is finite (one host synchronisation per parameter)."""
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _checked_sums(sums: Tensor, epoch: int) -> tuple[float, float]:
    """The device sums (loss, correct) on the host; a non-finite loss on any process stops
    every process here, at the same step."""
    finite = torch.isfinite(sums[:1]).float()
    if _distributed():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    loss_sum, correct = sums.tolist()
    if not finite.item():
        raise LofastError(f"training diverged at epoch {epoch + 1} (non-finite loss); lower "
                          "the learning rate")
    return loss_sum, correct


class StopSignals:
    """While entered on the main thread, the first SIGINT (Ctrl-C) or SIGTERM (a batch
    scheduler's stop, `timeout`, torchrun passing either on) raises nothing where the program
    happens to be, perhaps inside an optimizer step, but is kept in ``received`` for the
    training loop, which stops at the next step boundary with the state saved, as at a time
    limit. The handlers in place before are back from then on, so a second signal interrupts
    at once (work since the last saved state is then lost). Elsewhere than on the main thread
    Python cannot take signals, and this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received = 0  # the signal's number, 0 while none came
        self._previous: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._receive)
        return self

    def _receive(self, signum: int, frame: object) -> None:
        self.received = signum
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            # None: a handler not set from Python, which cannot be put back; the default
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def __exit__(self, *exc: object) -> None:
        self._restore()


TIME_LIMIT = 1  # _stop_requested's code for a passed deadline (signal numbers are larger)


def _stop_requested(deadline: float | None, signals: StopSignals | None) -> int:
    """Why training stops at this step boundary: 0 it does not, TIME_LIMIT its deadline
    passed, else the number of the signal received. The same answer on every process (the
    largest code decides), so that all stop at one step."""
    code = 0 if signals is None else signals.received
    if not code and deadline is not None and time.monotonic() >= deadline:
        code = TIME_LIMIT
    if _distributed():
        agreed = torch.tensor(float(code))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # gloo: CPU tensors
        code = int(agreed)
    return code


def _stopped(code: int, where: str, history: list[EpochStats]) -> BaseException:
    """The exception that ends a run stopped for ``code`` (``_stop_requested``)."""
    if code == TIME_LIMIT:
        return TimeLimitReached(where, history)
    return TrainingInterrupted(where, history, code)


def _summed(loss_sum: float, correct: int, seen: int,
            device: torch.device) -> tuple[float, int, int]:
    """An epoch's loss and accuracy sums over every process (unchanged with one)."""
    if not _distributed():
        return loss_sum, correct, seen
    totals = torch.tensor([loss_sum, correct, seen], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return totals[0].item(), int(totals[1].item()), int(totals[2].item())


def save_training_state(path: Path, model: LipschitzViT, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler,
                        generators: tuple[torch.Generator, torch.Generator], epoch: int,
                        config: TrainConfig, history: list[EpochStats],
                        bound: TrainingBound | None = None, plan: dict | None = None,
                        partial: dict | None = None) -> None:
    """`generators`: the run's (host, augmentation) random generators; `epoch` counts finished
    epochs; `partial` is the position inside the next one where a time limit stopped it (None
    at an epoch's end)."""
    state = {
        "plan": plan or {},
        "partial": partial,
        "bound": bound.state() if bound is not None else {},
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "generator": generators[0].get_state(),
        "augment_generator": generators[1].get_state(),
        "epoch": epoch,
        "train_config": plain_dict(config),
        "history": [asdict(h) for h in history],
    }
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_training_state(path: Path) -> dict:
    """Read a state file written by save_training_state (tensors and plain data only)."""
    check_readable(path, "training state")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for corrupt files
        raise LofastError(f"{path}: unreadable training state ({type(e).__name__})") from None
