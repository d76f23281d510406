"""Accumulates per-step results of one request into a vLLM-shaped ``RequestOutput``."""
from __future__ import annotations

import dataclasses

from moeflow.core import CompletionOutput, Logprob, LogprobsDict, Request, RequestMetrics, RequestOutput
from moeflow.engine.base import clock


class OutputTracker:
    def __init__(self, request: Request, tokenizer):
        self.request = request
        self.tokenizer = tokenizer
        self.metrics = RequestMetrics(arrival_s=request.arrival_s)
        wants_plp = request.params.prompt_logprobs is not None
        self.prompt_logprobs: list[LogprobsDict | None] | None = [None] if wants_plp else None
        self.logprobs: list[LogprobsDict] | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if request.params.logprobs is not None else None

    def _dict(self, raw) -> LogprobsDict:
        return {t: Logprob(lp, rank, self.tokenizer.decode([t])) for t, (lp, rank) in raw.items()}

    def on_step(self, seq_output) -> None:
        now = clock()
        if self.metrics.first_scheduled_s is None:
            t = seq_output.timing
            self.metrics.first_scheduled_s = t.start_s if t is not None else now
        if self.prompt_logprobs is not None:
            self.prompt_logprobs += [self._dict(d) for d in seq_output.prompt_logprobs]
        if seq_output.handoff_s is not None:
            self.metrics.kv_handoff_s = seq_output.handoff_s
        if seq_output.token_id is not None:
            if self.metrics.first_token_s is None:
                self.metrics.first_token_s = now
                t = seq_output.timing
                if t is not None:
                    self.metrics.prefill_start_s = t.start_s
                    self.metrics.prefill_compute_s = t.compute_s
                    self.metrics.prefill_wait_s = t.wait_s
            self.metrics.token_times_s.append(now)
            if self.logprobs is not None:
                self.logprobs.append(self._dict(seq_output.logprobs))
                self.cumulative_logprob += seq_output.logprobs[seq_output.token_id][0]

    def output(self) -> RequestOutput:
        r = self.request
        finished = r.finish_reason is not None
        if finished and self.metrics.finished_s is None:
            self.metrics.finished_s = clock()
        if r.stop_strings is not None:
            if finished:
                r.stop_strings.finish()  # an abort or error ends it too: the held text goes out
            text = r.stop_strings.text
        else:
            text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        completion = CompletionOutput(
            index=0, text=text,
            token_ids=list(r.output_token_ids), cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason)
        return RequestOutput(r.request_id, r.prompt, list(r.prompt_token_ids), self.prompt_logprobs,
                             [completion], finished, self.metrics, r.error)


def merge_samples(request_id: str, outputs: list[RequestOutput]) -> RequestOutput:
    """The n samples of one prompt (``LLM.make_requests``) as one output: its completions in
    sample order, the first sample's prompt logprobs and metrics, finished when all are."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outputs)]
    error = next((o.error for o in outputs if o.error is not None), None)
    return RequestOutput(request_id, first.prompt, first.prompt_token_ids,
                         first.prompt_logprobs, completions, all(o.finished for o in outputs), first.metrics, error)
