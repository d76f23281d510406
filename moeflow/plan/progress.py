"""The search's one line on stderr: what is done, what is left, and how long that should take.

Each phase (the sides, then each round of whole simulations) redraws the line as a simulation
ends. What is left of the whole simulations is an upper bound: a round stops the search once no
estimate beats the best simulated rate (``search``'s rule), so "at most". Its time is the mean
wall time of those that ended so far, spread over the workers; before the first ends there is
nothing to go by and the line says so.
"""
from __future__ import annotations

import time


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"


class Progress:
    def __init__(self, out, jobs: int):
        self.out, self.jobs = out, max(jobs, 1)
        self.t0 = time.monotonic()
        self.whole_walls: list[float] = []  # wall seconds of each whole simulation that ended
        self._width = 0  # the longest line so far: a shorter one pads over it (no terminal codes in logs)

    def _show(self, text: str) -> None:
        if self.out is not None:
            self._width = max(self._width, len(text))
            print(f"\rplan: {text:<{self._width}}", end="", file=self.out, flush=True)

    def sides(self, done: int, total: int, walls: list[float]) -> None:
        left = total - done
        eta = f", ~{_duration(sum(walls) / len(walls) * left / self.jobs)} left" if walls and left else ""
        self._show(f"sides {done}/{total} simulated ({_duration(time.monotonic() - self.t0)}){eta}")

    def whole(self, running: int, at_most_left: int, wall_s: float | None = None) -> None:
        """A whole simulation ended (``wall_s``) or a round started; ``running`` are under way and
        at most ``at_most_left`` more (those running included) will be simulated."""
        if wall_s is not None:
            self.whole_walls.append(wall_s)
        w = self.whole_walls
        if not at_most_left:
            eta = ""
        elif w:
            mean = sum(w) / len(w)
            eta = f", ~{_duration(mean * -(-at_most_left // self.jobs))} at {_duration(mean)} each"
        else:
            eta = f" ({running} running; time unknown until the first ends)"
        self._show(f"whole simulations: {len(w)} done, at most {at_most_left} left{eta}")

    def end(self) -> None:
        if self.out is not None:
            print(file=self.out, flush=True)
