"""Environments for the episode tests (``--env.fn support.envs:Class``): what they answer is
deterministic (how long :class:`Unhurried` takes is not)."""

from __future__ import annotations


class ThreeTurns:
    """Three model turns, whatever the model says: each answered "Go on." with a reward of 0.25."""

    def reset(self, row: dict) -> list[dict]:
        self.turns = 0
        return [{"role": "user", "content": f"Say something about {row['answer']}."}]

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        self.turns += 1
        return [{"role": "user", "content": "Go on."}], 0.25, self.turns >= 3


class FailsOnSecondTurn(ThreeTurns):
    """Raises in its second step (the run stops naming the environment and the row, or skips the episode)."""

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        if self.turns == 1:
            raise RuntimeError("the environment broke")
        return super().step(reply)


class HangsOnStep(ThreeTurns):
    """Its first step blocks until :attr:`release` is set (an environment that hangs)."""

    import threading

    release = threading.Event()

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        self.release.wait()
        return super().step(reply)


class Unhurried(ThreeTurns):
    """:class:`ThreeTurns` that takes an unseeded random 0-50 ms per step, as a busy machine or a remote
    environment would: the order in which episodes come back differs from run to run."""

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        import random
        import time

        time.sleep(random.SystemRandom().uniform(0.0, 0.05))
        return super().step(reply)
