"""The Lightning internals (with no public route) vitlab's exact resume and checkpoints rely on, each
with the reason. Tested on `TESTED_LIGHTNING`: a silently changed internal would break exact resume
without an error, so `check_lightning_version` stops a run on any other version."""

from __future__ import annotations

from typing import Any

import lightning as L

TESTED_LIGHTNING = "2.6"  # major.minor

# Every private attribute of Lightning, torch, torchdata and jsonargparse that vitlab reaches, where, and why
# there is no public route. Checked on Lightning 2.6.6, torch 2.14.1, torchdata 0.11.0, jsonargparse 4.53.0.
PRIVATE_USES: tuple[tuple[str, str, str], ...] = (
    ("ModelCheckpoint._save_last_checkpoint, _should_skip_saving_checkpoint", "reliability/last_checkpoint.py",
     "Lightning writes last.ckpt only at its own triggers; vitlab also writes it after every validation and "
     "on a signal"),
    ("ModelCheckpoint._should_save_on_train_epoch_end, _find_last_checkpoints, _fs",
     "reliability/last_checkpoint.py", "the default folder (<default_root_dir>/checkpoints), also for "
     "ckpt_path='last', and the same epoch-end-or-validation choice as Lightning's"),
    ("FitLoop._data_fetcher; the checkpoint's loops.fit_loop.state_dict.combined_loader",
     "restart_fetcher, pop_loader_states below", "the fetcher made its iterator before the loaders' states "
     "were restored; Lightning's copy of rank 0's loader state is applied once, per rank, by ExactResume"),
    ("FitLoop._should_accumulate, Trainer._logger_connector.should_update_logs", "run/callbacks.py PerfMonitor",
     "ThroughputMonitor has no hook for 'only at a logging step'"),
    ("ThroughputMonitor._samples, _batches", "run/callbacks.py PerfMonitor", "its counters, updated at logging "
     "steps only"),
    ("EMAWeightAveraging/WeightAveraging._average_model, _device, _kwargs, _use_buffers, _latest_update_*",
     "run/callbacks.py EMA, run/figures.py", "vitlab's modules build the model in __init__; the EMA copy is made "
     "without configure_model, and the figures draw with it"),
    ("LightningModule._trainer", "objectives/classifier.py, objectives/optim.py", "`trainer` raises when unset "
     "(a module used outside a Trainer)"),
    ("lightning.fabric.plugins.precision.amp._optimizer_handles_unscaling", "objectives/optim.py",
     "which optimizers unscale gradients themselves (the bf16 clipping override)"),
    ("optimizer.found_inf (torch.amp.GradScaler protocol)", "grad_step.py, reliability/guards.py",
     "skip a step with a non-finite gradient without a host sync"),
    ("torch.utils._foreach_utils._get_fused_kernels_supported_devices", "objectives/optim.py",
     "which devices AdamW(fused=True) supports"),
    ("torch.cpu._is_avx512_bf16_supported, _is_amx_tile_supported", "run/defaults.py", "torch's bf16 probe"),
    ("StatefulDataLoader state '_num_yielded', '_iterator_finished'", "reliability/resume.py",
     "whether a saved epoch was finished"),
    ("jsonargparse ArgumentParser._actions", "cli.py", "the top-level keys a subcommand takes"),
)


def check_lightning_version(version: str | None = None) -> None:
    """Raise RuntimeError unless Lightning is a `TESTED_LIGHTNING` release."""
    version = L.__version__ if version is None else version
    if version.split(".")[:2] != TESTED_LIGHTNING.split("."):
        raise RuntimeError(
            f"vitlab's exact resume and signal handling use Lightning internals tested on Lightning "
            f"{TESTED_LIGHTNING}.x, but Lightning {version} is installed. Install a tested release "
            f"(pip install 'lightning~={TESTED_LIGHTNING}.0'), or check "
            "vitlab/train/reliability/lightning_internals.py against this version and update TESTED_LIGHTNING."
        )


def pop_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Take the train loaders' states (rank 0's) out of a checkpoint, or Lightning would apply them on every
    rank whenever `FitLoop.setup_data` runs after the restore."""
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    return fit_state.pop("combined_loader", None) or None


def restart_fetcher(trainer: L.Trainer) -> None:
    """Make the fit loop's fetcher start a new iterator: it made its own before the loaders' states were
    restored, and a resumed epoch makes no new one."""
    iter(trainer.fit_loop._data_fetcher)
