"""The trainer side of the rollout weights: the policy pushed after every optimizer step (and on resume), versioned
by the global step, and every rollout checked against the version it should have been served on.

`RolloutWeightSync` is the `TrainerCallback` that pushes; `check_served_versions` the check each batch of
trajectories passes (`StaleRolloutError`, or `rollout/stale_trajectories` with `allow_stale_rollouts=True`).
"""

from __future__ import annotations

import logging
import math
import time

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class StaleRolloutError(RuntimeError):
    """Trajectories were served on a weight version other than the trainer's (see `allow_stale_rollouts`)."""


class RolloutWeightSync(TrainerCallback):
    """Pushes the policy to the rollout engine after each optimizer step, and once on resume."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed run loaded checkpoint weights the engine has never seen; a fresh run's engine already serves
        # the initial policy (the embedded engine is built from it; an SGLang server is launched from the same
        # checkpoint).
        if state.global_step > 0 and self.trainer.rollout_engine.weight_version != state.global_step:
            self.trainer.sync_rollout_weights()
        elif state.global_step == 0 and servers_hold_other_weights(self.trainer):
            self.trainer.sync_rollout_weights()  # version 0: the initial policy
        if state.global_step > 0:  # synced now, or the engine already holds the checkpoint's step
            self.trainer.synced_weight_version = state.global_step

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        metrics = self.trainer._metrics["train"]
        if getattr(self, "step_start", None) is not None:  # generation (if any), log-probs, forward/backward, update
            metrics["timing/step_s"].append(time.perf_counter() - self.step_start)
            self.step_start = None
        self.trainer.sync_rollout_weights()
        self.trainer.synced_weight_version = state.global_step


def sync_rollout_weights(trainer) -> None:
    """Send the current policy to the rollout engine, versioned by the global step.

    With SGLang the main process syncs; its outcome is broadcast so that every process raises when it failed
    (instead of the other ranks waiting at a barrier until the collective timeout). The push's seconds are logged as
    ``timing/weight_sync_s`` and, where the engine's weight sync keeps a ``sync_history``, are its record's
    ``sync_total_s``.
    """
    error = None
    history = getattr(getattr(trainer.rollout_engine, "weight_sync", None), "sync_history", None)
    before = history[-1] if history else None
    start = time.perf_counter()
    try:
        trainer._push_weights(trainer.rollout_engine, version=trainer.state.global_step)
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
        error = exc
    seconds = time.perf_counter() - start
    trainer._metrics["train"]["timing/weight_sync_s"].append(seconds)
    if history and history[-1] is not before:  # this push's record (`trl_ext.weight_sync.history`): its whole time
        history[-1].sync_total_s = seconds
    verify_s = getattr(getattr(trainer.rollout_engine, "weight_sync", None), "last_verify_s", None)
    if error is None and verify_s is not None:  # SGLang: the sync's checks (served version, checksums)
        trainer._metrics["train"]["timing/weight_sync_verify_s"].append(verify_s)
    if trainer.args.rollout_backend == "sglang" and trainer.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        outcome = [None if error is None else f"{type(error).__name__}: {error}"]
        broadcast_object_list(outcome, from_process=0)
        if error is None and outcome[0] is not None:
            from .weight_sync import WeightSyncError

            raise WeightSyncError(f"rollout weight sync failed on the main process: {outcome[0]}")
    if error is not None:
        from .weight_sync import ServerLostError

        if isinstance(error, ServerLostError):
            from .checkpoints import resume_hint
            from .rollout.recovery import RolloutServerLostError

            raise RolloutServerLostError(
                f"{error}. Training stops here; {resume_hint(trainer.args.output_dir)} once the server serves again."
            ) from error
        raise error


def push_weights(trainer, engine, version: int) -> None:
    from .weight_sync import push_policy_weights

    remote = trainer.args.rollout_backend == "sglang"
    probe = None
    if remote and "logprobs" in trainer.args.weight_sync_verify:
        probe = trainer._tokenizer.encode(_WEIGHT_SYNC_PROBE_TEXT, add_special_tokens=False)[:48]
    push_policy_weights(
        engine,
        trainer.model if trainer.is_fsdp_enabled else trainer.accelerator.unwrap_model(trainer.model),
        version=version,
        accelerator=trainer.accelerator,
        is_fsdp=trainer.is_fsdp_enabled,
        lora=remote and trainer.args.weight_sync_lora,
        is_main_process=trainer.accelerator.is_main_process or not remote,  # one process talks to the servers
        probe_ids=probe,
    )


def servers_hold_other_weights(trainer) -> bool:
    """Whether a fresh run's rollout servers serve weights other than their launch ones or version 0: another
    run's, or this run's own from before a kill that came before its first checkpoint. Decided on the main
    process, for all."""
    engine, held = trainer.rollout_engine, {}
    if hasattr(engine, "served_versions") and trainer.accelerator.is_main_process:
        held = {u: v for u, v in engine.served_versions().items() if not _is_current_version(v, None)}
        if held:
            logger.warning(
                "rollout servers serve weight versions %s, not the initial policy: pushing it to them (version 0)",
                held,
            )
    if trainer.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        decision = [bool(held)]
        broadcast_object_list(decision, from_process=0)
        return decision[0]
    return bool(held)


def check_served_versions(trainer, trajectories: list) -> None:
    """Log the versions that served this batch and fail on trajectories served on another version.

    A trajectory is stale when one of its turns was served (the engine's answer says so) on a version other than
    `synced_weight_version`, the global step of the trainer's last sync; before the first sync the engine must
    serve the initial policy, which engines report as version 0 or without a version (SGLang's `"default"`).
    `rollout/weight_version` is the oldest version served in the batch (an answer without a version counts as 0:
    the weights its server was launched with), `rollout/stale_trajectories` the number of stale trajectories; both
    over all processes, which all raise together (`StaleRolloutError`) unless `allow_stale_rollouts`.
    """
    expected = trainer.synced_weight_version
    stale = [t for t in trajectories if not all(_is_current_version(v, expected) for v in t.weight_versions)]
    numbers = [n for t in trajectories for n in map(_version_number, t.weight_versions) if n is not None]
    local = torch.tensor(
        [len(stale), len(trajectories), min(numbers, default=math.inf)],
        dtype=torch.float64,
        device=trainer.accelerator.device,
    )
    gathered = trainer.accelerator.gather(local).reshape(-1, 3)
    num_stale, total, oldest = gathered[:, 0].sum().item(), gathered[:, 1].sum().item(), gathered[:, 2].min().item()
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    metrics["rollout/stale_trajectories"].append(num_stale)
    if math.isfinite(oldest):  # every process skips it alike: no engine gave a numeric version
        metrics["rollout/weight_version"].append(oldest)
    if num_stale == 0:
        return
    from accelerate.utils import gather_object

    wrong = {v for t in stale for v in t.weight_versions if not _is_current_version(v, expected)}
    served = sorted(set(gather_object(sorted(wrong, key=repr))), key=repr)
    if expected is None:
        want = "0, the initial policy (no weight sync yet)"
        why = "a server still holds weights loaded before this run (another run's sync)"
    else:
        want = f"{expected} (the global step of the trainer's last weight sync)"
        why = "a server restarted or was reloaded since the last sync, or a sync did not reach it"
    if None in served:
        why += " (None: an answer without a version, SGLang's 'default', i.e. a server on its launch weights)"
    message = (
        f"{num_stale:.0f} of {total:.0f} trajectories of this batch had turns served on weight version(s) "
        f"{served}, expected {want}: the rollout engine did not serve the policy being trained; {why}."
    )
    if not trainer.args.allow_stale_rollouts:
        raise StaleRolloutError(
            f"{message} Set allow_stale_rollouts=True to train on such trajectories anyway (counted in "
            "rollout/stale_trajectories)."
        )
    logger.warning("%s Training on them (allow_stale_rollouts=True).", message)


# A fixed, ordinary sentence: the "logprobs" sync check scores it on every server and in the trainer.
_WEIGHT_SYNC_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers that changed "
    "physics: on the photoelectric effect, Brownian motion, special relativity and mass-energy equivalence."
)


def _is_current_version(served, expected) -> bool:
    """Whether a turn served on version `served` was sampled by the trainer's weights, version `expected` (the
    global step of the last sync; None before the first: the initial policy, reported as 0 or without a version)."""
    if expected is None:
        return served is None or str(served) == "0"
    return served is not None and str(served) == str(expected)


def _version_number(version) -> float | None:
    """A served version as a number for `rollout/weight_version`: None (the server's launch weights) is 0, a
    version that is not a number (a label) is left out."""
    if version is None:
        return 0.0
    try:
        return float(version)
    except (TypeError, ValueError):
        return None
