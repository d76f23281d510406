"""How an elastic system of global steps (``elastic_afd.py``, ``elastic_dep.py``) carries a membership
change out as the engine does: between steps, once it is ready."""
from __future__ import annotations


class BoundaryChange:
    """``_change``: the change under way, (side, target, ready at; None: once the leavers are drained)."""

    _change: tuple | None = None

    def _idle_boundary(self) -> None:
        """A change that became ready while no step runs takes effect now."""
        if not self.busy:
            self._boundary()
            self.poke()

    def _step(self) -> None:
        self._boundary()
        super()._step()

    def _due(self) -> tuple | None:
        """(side, target) of the change under way once its joiners are ready; None before, or without one."""
        if self._change is None:
            return None
        side, target, ready = self._change
        return None if ready is not None and self.loop.now < ready else (side, target)

    def _boundary(self) -> None:
        """Between steps: the change under way takes effect once it can."""
        raise NotImplementedError
