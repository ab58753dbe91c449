"""The episode runner of a run, built from its config: written once, for the trainer's colocated
rollout and for the rollout pool's ranks (:mod:`spmd_rl.serve`), which play the episodes there.

    if episodes_on(cfg):
        runner = build_episode_runner(cfg, tokenizer, eos_ids)   # an EpisodeRunner or an AgentRunner
        engine_prompt = episode_prompt_length(cfg)               # an episode's longest prefix
"""

from __future__ import annotations

from typing import Any

from spmd_rl.episodes.agent import AgentRunner, load_agent
from spmd_rl.episodes.env import load_env
from spmd_rl.episodes.framing import TurnFraming
from spmd_rl.episodes.runner import EpisodeRunner
from spmd_rl.episodes.tool_prompt import supports_tools
from spmd_rl.episodes.tools import build_tools


def episodes_on(cfg: Any) -> bool:
    """Whether every response is a multi-turn episode (``--env.*`` or ``--agent.fn``)."""
    return bool(cfg.env.enabled or cfg.agent.fn is not None)


def episode_prompt_length(cfg: Any) -> int:
    """The longest prefix the rollout engine is fed: a prompt, plus an episode's tokens with episodes."""
    return cfg.data.max_prompt_length + (cfg.env.max_tokens if episodes_on(cfg) else 0)


def build_episode_runner(cfg: Any, tokenizer: Any, eos_ids: list[int]) -> EpisodeRunner | AgentRunner:
    """The runner that plays the run's episodes: an agent through the endpoint (``agent.fn``), else
    an environment (``env.fn`` / ``env.name``) with its tools (``env.tools``)."""
    env, agent = cfg.env, cfg.agent
    skip = cfg.reward.on_error == "skip"
    if agent.fn is not None:
        return AgentRunner(load_agent(agent.fn), tokenizer=tokenizer, eos_ids=eos_ids, max_turns=env.max_turns,
                           max_tokens=env.max_tokens, workers=env.workers, skip_errors=skip, host=agent.host,
                           timeout_s=agent.timeout_s)
    tools = build_tools(env.tools) if env.tools else None
    native = bool(tools) and supports_tools(tokenizer)  # the template renders tools=: else a prompt says how
    framing = TurnFraming(tokenizer, eos_ids=eos_ids, tools=[t.schema() for t in tools.values()] if native else None)
    return EpisodeRunner(load_env(env.fn, env.name), framing=framing, tokenizer=tokenizer, max_turns=env.max_turns,
                         max_tokens=env.max_tokens, tools=tools, workers=env.workers, skip_errors=skip,
                         tools_as_user=not native, warn_after_s=cfg.trainer.stall_timeout_s)


__all__ = ["build_episode_runner", "episode_prompt_length", "episodes_on"]
