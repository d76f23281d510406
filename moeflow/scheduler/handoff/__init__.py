"""The KV handoff between a prefill side and a decode side: the sides (``sides.py``), the port each
talks to its engine through (``port.py``), and a pd deployment's state machine (``deployment.py``)."""

from moeflow.scheduler.handoff.arrivals import Arrivals  # noqa: F401  (the decode side's reservations)
