"""What a rollout batch says about the servers that sampled it, for a trainer that must never train on wrong rollouts.

- A server that restarted (a supervisor started it again after a crash) serves its launch weights, which SGLang
  reports as ``weight_version`` ``"default"`` (no version). Turns served without a version while the trainer expects
  a trained version (a global step > 0) come from such a server: the batch is sampled again once the current
  weights were pushed and verified (`served_on_launch_weights`).
- A server that a request gave up on (no answer within the engine's retry deadline) is gone: its trajectories were
  aborted, and training stops with `RolloutServerLostError`, naming it and the checkpoint to resume from.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["RESTART_RECOVERIES", "RolloutServerLostError", "served_on_launch_weights"]

# batches sampled again in one step after server restarts: a server that restarts again and again stops training
# (with the stale-rollout error) instead of holding it
RESTART_RECOVERIES = 2


class RolloutServerLostError(RuntimeError):
    """A rollout server stopped answering and did not answer again within the deadline. The message names the
    server, its last error and the checkpoint to resume from; the run's checkpoints are left as they were."""


def served_on_launch_weights(trajectories: Iterable, expected_version) -> int:
    """How many ``trajectories`` have a turn served without a weight version (a server on its launch weights) while
    the trainer expects ``expected_version``, a trained version (None or 0: the initial policy, which the launch
    weights are)."""
    if expected_version is None or str(expected_version) == "0":
        return 0
    return sum(1 for t in trajectories if any(v is None for v in t.weight_versions))
