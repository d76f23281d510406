"""moeflow: an inference engine for Mixture-of-Experts models without global barriers."""
from moeflow.core import CompletionOutput, Logprob, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # NOTE: LLM is imported on first use: every ``import moeflow.<module>`` runs this file, and an
    # eager import would pull torch into the pure-Python scheduler, core and simulator.
    if name == "LLM":
        from moeflow.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'moeflow' has no attribute {name!r}")
