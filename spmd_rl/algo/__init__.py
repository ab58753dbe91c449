"""Pure-tensor RL algorithm pieces: advantage estimators and policy losses.

Usage::

    from spmd_rl.algo import advantages, losses
    adv = advantages.grpo(scores, group_index, response_mask)
    loss, metrics = losses.ppo_clip(logp, old_logp, adv, response_mask)

Nothing here knows about processes, devices or engines.
"""

from spmd_rl.algo import advantages, losses

__all__ = ["advantages", "losses"]
