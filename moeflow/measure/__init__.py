"""What a benchmark and the simulator measure alike, torch-free: workloads (``workload``), serving
metrics (``metrics``), the SLO search (``slo``), statistics over repeats (``stats``), the saturation
probe (``saturation``), the machine's capacity and time splits (``capacity``), provenance of every
result file (``provenance``), and the report tables and plot (``compare_report``, ``decode_report``,
``plot``). ``bench/`` runs the real engine over it; ``sim/`` runs the simulator over it.
"""
