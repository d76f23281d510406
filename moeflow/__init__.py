"""moeflow: an inference engine for Mixture-of-Experts models without global barriers."""
from moeflow.core import CompletionOutput, Logprob, RequestOutput, SamplingParams
from moeflow.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
