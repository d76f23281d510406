"""Experiment files: one YAML drives both the real engine (``bench``) and the simulator (``sim``).

``serve.py``: the serving experiment (workload, rates, SLO search; ``bench compare``, ``moeflow
simulate``); ``decode.py``: the decode experiment (contexts, the timed window; ``bench decode``,
``moeflow simulate``). Both hold ``systems:`` entries (``system.py``) and the simulator's target
(``target.py``), each parsed and validated once. Pure Python: no torch, no runtime.
"""
