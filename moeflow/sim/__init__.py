"""Discrete-event simulator of moeflow's modes at cluster scale.

It drives the engine's own schedulers (``moeflow.scheduler``) with workloads from
``moeflow.measure.workload`` against a cost model (``cost.py``: roofline + links, or tables that
``moeflow profile`` measured), and reports in ``bench serve``'s schema. No torch, no wall clock.
"""
