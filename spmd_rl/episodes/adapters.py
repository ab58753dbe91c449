"""Environments of other frameworks behind the ``Env`` interface: TextArena's single-player games.

:class:`TextArenaEnv` plays one game of ``textarena`` (``pip install textarena``; pure Python, runs
offline) per episode. The game comes from the row's ``env_id`` or the class attribute ``env_id``, its
seed from the row's ``seed`` and its keyword arguments from the row's ``env_kwargs``; rows are made by
:func:`textarena_rows`. Use a ``-raw`` id (``GuessTheNumber-v0-raw``): the game's new messages each turn
become one user message (a wrapped id such as ``GuessTheNumber-v0`` returns its whole history as one
text every turn, which a chat would hold twice). The reward is the game's reward for player 0 at the end
(TextArena's own scale: some games give partial credit or a negative reward for invalid moves), 0 before.
``--env.name textarena`` takes the game from the rows; a fixed game is a subclass::

    class Wordle(TextArenaEnv):
        env_id = "Wordle-v0-raw"          # --env.fn my_envs:Wordle

TextArena draws from Python's global ``random`` (and seeds it in ``reset``). The adapter runs every
call of the game under one lock with the episode's own ``random`` state swapped in, so episodes are
reproducible from their seed whatever runs beside them, and the process's global state is left as it
was. Multi-player games are refused (the interface has one player).
"""

from __future__ import annotations

import random
import threading
from contextlib import contextmanager
from typing import Any, ClassVar, Iterator

_RANDOM_LOCK = threading.Lock()


def _import_textarena() -> Any:
    try:
        import textarena
    except ImportError as e:
        raise ImportError(f"TextArenaEnv needs the textarena package (pip install textarena): {e}") from e
    return textarena


class TextArenaEnv:
    """One TextArena single-player game per episode (see the module docstring)."""

    env_id: ClassVar[str | None] = None
    """The game when the row names none (``GuessTheNumber-v0-raw``, ``Wordle-v0-raw``, ...)."""

    def __init__(self) -> None:
        self._game: Any = None
        self._random: Any = None
        self.info: dict[str, Any] = {}

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        with _RANDOM_LOCK:
            saved = random.getstate()
            if self._random is not None:
                random.setstate(self._random)
            try:
                yield
            finally:
                self._random = random.getstate()
                random.setstate(saved)

    def _observation(self) -> str:
        player, observation = self._game.get_observation()
        if isinstance(observation, str):
            return observation.strip()
        # raw games: (sender, text, kind) since the last turn; the player's own move is not repeated
        return "\n".join(text for sender, text, kind in observation
                         if sender != player and getattr(kind, "name", None) != "PLAYER_ACTION").strip()

    def reset(self, row: dict) -> list[dict]:
        ta = _import_textarena()
        env_id = row.get("env_id") or self.env_id
        if not env_id:
            raise ValueError("TextArenaEnv: no game; give the row an `env_id` or set the class attribute env_id")
        seed = row.get("seed")
        self._random = None
        with self._own_random():
            self._game = ta.make(env_id, **dict(row.get("env_kwargs") or {}))
            try:
                self._game.reset(num_players=1, seed=seed)
            except AssertionError as e:
                raise ValueError(f"TextArenaEnv: {env_id} is not a single-player game ({e})") from e
            self.turns = 0
            return [{"role": "user", "content": self._observation()}]

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        if self._game is None:
            raise RuntimeError("TextArenaEnv.step before reset")
        self.turns += 1
        with self._own_random():
            done, _ = self._game.step(reply)
            if done:
                rewards, self.info = self._game.close()
                return [], float((rewards or {}).get(0, 0.0)), True
            return [{"role": "user", "content": self._observation()}], 0.0, False


def textarena_rows(env_id: str, n: int, seed: int) -> list[dict]:
    """``n`` rows playing ``env_id``, each with its own seed drawn from ``seed``."""
    if n < 0:
        raise ValueError(f"textarena_rows: n must be >= 0, got {n}")
    rng = random.Random(f"{seed}/textarena/{env_id}")
    return [{"env_id": env_id, "seed": rng.randrange(2**31)} for _ in range(n)]


__all__ = ["TextArenaEnv", "textarena_rows"]
