"""Checkpoints under Trainer: HostAdamW's state per unit, and checkpoint folders that appear whole.

Three of Trainer's private methods are overridden on the instance (each has a test that fails if
transformers changes what it overrides):

* ``_save_optimizer_and_scheduler``: HostAdamW's state as one safetensors file per unit
  (``megatrain_hf/optim/state_files.py``) instead of one pickle of the whole state; the scheduler as
  Trainer saves it.
* ``_load_optimizer_and_scheduler``: loads that folder in place; anything else goes to Trainer's
  own loader, with pickles other than tensors refused with a clear message.
* ``_save_checkpoint``: Trainer's own, run unchanged but with its run directory pointed at a
  hidden staging folder ``.checkpoint-N.tmp-<pid>``; everything written is fsync'ed, then renamed
  to ``checkpoint-N`` (one atomic rename), so a process killed while saving never leaves a partial
  folder that ``resume_from_checkpoint=True`` would pick up. Trainer's own rotation
  (``rotate_checkpoints``) and its best-checkpoint rule then run on the real run directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import warnings

import torch
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME

from ...errors import CheckpointError, UnreadableCheckpointError
from ...optim.state_files import OPTIMIZER_DIR, atomic_write, fsync_path, fsync_tree, has_sharded_optimizer
from ...optim.state_files import load_optimizer, save_optimizer
from ...core.patcher import Patcher
from ...optim.host_adamw import HostAdamW

logger = logging.getLogger(__name__)

_STAGING = ".{name}.tmp-{pid}"  # hidden: Trainer's globs (checkpoint-*) never see a folder being written


def host_adamw(trainer) -> HostAdamW | None:
    """The trainer's optimizer if it is a HostAdamW (under accelerate's wrapper)."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return optimizer if isinstance(optimizer, HostAdamW) else None


def install(patcher: Patcher, trainer) -> None:
    original_save_checkpoint = trainer._save_checkpoint
    original_get_output_dir = trainer._get_output_dir
    original_save_opt = trainer._save_optimizer_and_scheduler
    original_load_opt = trainer._load_optimizer_and_scheduler

    def _save_checkpoint(model, trial):
        return _staged_save_checkpoint(trainer, patcher, original_save_checkpoint, original_get_output_dir, model,
                                       trial)

    def _save_optimizer_and_scheduler(output_dir):
        optimizer = host_adamw(trainer)
        sharded = optimizer is not None and optimizer.store.ownership.sharding is not None  # every rank writes its units
        if optimizer is None or not (trainer.args.should_save or sharded):
            return original_save_opt(output_dir)
        save_optimizer(optimizer, os.path.join(output_dir, OPTIMIZER_DIR))
        if trainer.args.should_save:
            _save_scheduler(trainer, output_dir)

    def _load_optimizer_and_scheduler(checkpoint):
        sharded = checkpoint is not None and has_sharded_optimizer(checkpoint)
        try:
            return _load_sharded(trainer, checkpoint) if sharded else original_load_opt(checkpoint)
        except pickle.UnpicklingError as exc:  # torch.load(weights_only=True) met code or a foreign class
            files = SCHEDULER_NAME if sharded else f"{OPTIMIZER_NAME} or {SCHEDULER_NAME}"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UnreadableCheckpointError(
                f"megatrain: refused to load {files} of {checkpoint}: it holds pickled objects other than "
                "tensors and plain containers, which could run code (torch.load(weights_only=True) refused "
                f"it: {first}). Resume only from checkpoints you trust; nothing from the file was executed."
            ) from exc

    patcher.set_attr(trainer, "_save_checkpoint", _save_checkpoint)
    patcher.set_attr(trainer, "_save_optimizer_and_scheduler", _save_optimizer_and_scheduler)
    patcher.set_attr(trainer, "_load_optimizer_and_scheduler", _load_optimizer_and_scheduler)


def _save_scheduler(trainer, output_dir: str) -> None:
    """The LR scheduler exactly as Trainer saves it (torch.save of its state_dict), written atomically."""
    from transformers.trainer_pt_utils import reissue_pt_warnings

    state = trainer.lr_scheduler.state_dict()
    with warnings.catch_warnings(record=True) as caught_warnings:
        atomic_write(os.path.join(output_dir, SCHEDULER_NAME), lambda tmp: torch.save(state, tmp))
    reissue_pt_warnings(caught_warnings)


def _load_sharded(trainer, checkpoint: str) -> None:
    """Trainer's ``_load_optimizer_and_scheduler`` for a checkpoint holding HostAdamW's shards."""
    optimizer = host_adamw(trainer)
    folder = os.path.join(checkpoint, OPTIMIZER_DIR)
    if optimizer is None:
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        raise CheckpointError(
            f"{folder} holds megatrain's per-unit HostAdamW state, but this Trainer's optimizer is "
            f"{type(inner).__name__}. Resume with MegaTrainPlugin(replace_adamw=True) (the default) and "
            "the AdamW optimizer, or convert the folder with megatrain_hf.optim.state_files.to_torch_state_dict()."
        )
    scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
    if not os.path.isfile(scheduler_file):  # Trainer loads neither unless both exist
        logger.warning("megatrain: %s has no %s; optimizer and scheduler state not loaded", checkpoint, SCHEDULER_NAME)
        return
    load_optimizer(optimizer, folder)
    from transformers.trainer_pt_utils import reissue_pt_warnings

    with warnings.catch_warnings(record=True) as caught_warnings:
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
    reissue_pt_warnings(caught_warnings)


def _remove_stale_staging(run_dir: str) -> None:
    """Remove staging folders left by processes that were killed while saving (not by live ones)."""
    import psutil

    try:
        names = os.listdir(run_dir)
    except OSError:
        return
    for name in names:
        if not (name.startswith(".checkpoint-") and ".tmp-" in name):
            continue
        pid = name.rsplit(".tmp-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid() or psutil.pid_exists(int(pid)):
            continue  # ours, or that process still runs
        logger.info("megatrain: removing %s, left by an interrupted checkpoint save", name)
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def _staged_save_checkpoint(trainer, patcher: Patcher, original_save, original_get_output_dir, model, trial) -> None:
    """Trainer's ``_save_checkpoint``, made atomic (see module docstring)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    args = trainer.args
    optimizer = host_adamw(trainer)
    sharding = optimizer.store.ownership.sharding if optimizer is not None else None
    if args.push_to_hub or not (args.should_save or sharding is not None):
        return original_save(model, trial)  # (the hub upload reads the folder in the background)
    run_dir = original_get_output_dir(trial=trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    final = os.path.join(run_dir, name)
    pid = os.getpid() if sharding is None else sharding.rank0_pid()  # one staging folder for all ranks
    staging_root = os.path.join(run_dir, _STAGING.format(name=name, pid=pid))
    if args.should_save:
        os.makedirs(run_dir, exist_ok=True)
        _remove_stale_staging(run_dir)
        shutil.rmtree(staging_root, ignore_errors=True)
        os.makedirs(staging_root)
    if sharding is not None:
        sharding.barrier()  # the staging folder exists before any rank writes into it
    staged = os.path.join(staging_root, name)
    try:
        with patcher.temporarily(trainer, "_get_output_dir", lambda trial=None: staging_root), \
                _logged_as(staging_root, run_dir):
            original_save(model, trial)
    except BaseException:
        shutil.rmtree(staging_root, ignore_errors=True)
        raise
    if sharding is not None:
        sharding.barrier()  # every rank's shards are written
        if not args.should_save:
            sharding.barrier()  # rank 0 committed the folder
            return
        try:
            _commit(trainer, args, run_dir, name, final, staging_root, staged)
        finally:
            sharding.barrier()
        return
    _commit(trainer, args, run_dir, name, final, staging_root, staged)


class _PathFilter(logging.Filter):
    """Shows the final folder where a log record names the staging one ("Saving model checkpoint to ...")."""

    def __init__(self, hidden: str, shown: str) -> None:
        super().__init__()
        self.hidden, self.shown = hidden, shown

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and self.hidden in record.msg:
            record.msg = record.msg.replace(self.hidden, self.shown)
        if isinstance(record.args, tuple) and any(isinstance(a, str) and self.hidden in a for a in record.args):
            record.args = tuple(a.replace(self.hidden, self.shown) if isinstance(a, str) else a for a in record.args)
        return True


@contextlib.contextmanager
def _logged_as(hidden: str, shown: str):
    """While saving into the staging folder, every log handler shows the checkpoint's final path instead."""
    handlers = {id(h): h for h in logging.getLogger().handlers}
    for log in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(log, logging.Logger):
            handlers.update((id(h), h) for h in log.handlers)
    if logging.lastResort is not None:
        handlers[id(logging.lastResort)] = logging.lastResort
    path_filter = _PathFilter(hidden, shown)
    for handler in handlers.values():
        handler.addFilter(path_filter)
    try:
        yield
    finally:
        for handler in handlers.values():
            handler.removeFilter(path_filter)


def _commit(trainer, args, run_dir: str, name: str, final: str, staging_root: str, staged: str) -> None:
    """Rename the staged checkpoint to its final name (atomically) and rotate (see module docstring)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    # Trainer's best-checkpoint rule looked in the staging root; apply it to the run directory.
    state = trainer.state
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy in ("steps", "epoch", "best") and state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best):
            state.best_model_checkpoint = best
    if os.path.isfile(os.path.join(staged, TRAINER_STATE_NAME)):
        state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))

    fsync_tree(staging_root)
    trash = None
    if os.path.exists(final):  # saving the same step again (e.g. after resuming from an earlier one)
        trash = os.path.join(run_dir, _STAGING.format(name=name + ".old", pid=os.getpid()))
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(staged, final)  # the commit point
    fsync_path(run_dir)
    shutil.rmtree(staging_root, ignore_errors=True)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                       best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)
