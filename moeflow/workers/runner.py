"""ModelRunner: turns a scheduled ``Batch`` into tensors, runs the model, samples.

It keeps each request's tokens and sampling state (like vLLM's per-request worker state), so a
batch only names requests and counts. The colocated engine calls it in-process; attention
workers will call it behind a message loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.core import Batch, SamplingParams
from moeflow.logs import get_logger
from moeflow.messages import SeqOutput
from moeflow.model.decode_graphs import DecodeGraphs, GraphUnavailable
from moeflow.model.kv_cache import AttentionMetadata, KVCache
from moeflow.model.sampler import RowSampling, logprobs_of, logprobs_packed, logprobs_unpacked, sample_tokens
from moeflow.model.transformer import MoETransformer

_LOGITS_ROWS = 1024  # prompt logprobs are computed in slices to bound the [rows, V] buffer


@dataclass
class _ReqState:
    token_ids: list[int]  # the prompt, then every token sampled so far
    params: SamplingParams
    generator: torch.Generator | None
    num_prompt: int
    # EOS and stop tokens: not sampled before min_tokens (vLLM: EOS only without ignore_eos)
    min_tokens_banned: tuple[int, ...] = ()
    # prompt positions whose logprobs went out: a request preempted by recompute runs its prompt
    # again (from position 0), and its prompt logprobs are not sent twice
    prompt_logprobs_done: int = 0

    def row(self) -> RowSampling:
        p = self.params
        banned = self.min_tokens_banned if len(self.token_ids) - self.num_prompt < p.min_tokens else ()
        return RowSampling(p.temperature, p.top_k, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                           p.repetition_penalty, p.logit_bias, banned)


class ModelRunner:
    def __init__(self, model: MoETransformer, kv_cache: KVCache, seed: int = 0):
        self.model = model
        self.kv_cache = kv_cache
        self.requests: dict[str, _ReqState] = {}
        self.device = kv_cache.device  # the model's and the cache's: every tensor here is made there
        self._default_gen = self._generator(seed)
        self.graphs: DecodeGraphs | None = None  # decode from CUDA graphs (set by the engine: for_engine)

    def _generator(self, seed: int) -> torch.Generator:
        # NOTE: multinomial wants its generator on the probabilities' device; meta has no generator
        gen_device = "cpu" if self.device.type == "meta" else self.device
        return torch.Generator(device=gen_device).manual_seed(seed)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = (), generated: tuple[int, ...] = ()) -> None:
        """``generated``: tokens sampled elsewhere (a decode instance's first token, from its prefill
        instance); the prompt's logprobs went out from there too."""
        gen = self._generator(params.seed) if params.seed is not None else None
        banned = tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))))
        n = len(prompt_token_ids)
        self.requests[request_id] = _ReqState(list(prompt_token_ids) + list(generated), params, gen, n,
                                              banned if params.min_tokens else (), n if generated else 0)

    def remove_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, AttentionMetadata]:
        """The batch's new tokens [T] int64 (requests concatenated, no padding) and attention metadata."""
        seqs = batch.seqs
        states = [self.requests[s.request_id] for s in seqs]
        tokens = torch.tensor([t for s, st in zip(seqs, states)
                               for t in st.token_ids[s.start:s.start + s.num_tokens]], dtype=torch.int64,
                              device=self.device)  # [T]
        meta = AttentionMetadata.build([s.num_tokens for s in seqs], [s.start for s in seqs],
                                       [s.block_ids for s in seqs], self.kv_cache.block_size, self.device)
        return tokens, meta

    @torch.inference_mode()
    def execute(self, batch: Batch) -> dict[str, SeqOutput]:
        hidden = self._graphed(batch)
        if hidden is None:
            tokens, meta = self.prepare(batch)
            hidden = self.model.forward(tokens, meta, self.kv_cache)  # [T, H]
        return self.sample(batch, hidden)

    def _graphed(self, batch: Batch) -> torch.Tensor | None:
        """The hidden states of a pure decode batch from the graphs (None: not theirs to run)."""
        g, seqs = self.graphs, batch.seqs
        if g is None or not g.takes([s.num_tokens for s in seqs], [s.start for s in seqs]) \
                or not g.fits(len(seqs), max(len(s.block_ids) for s in seqs)):
            return None
        try:
            return g.run([self.requests[s.request_id].token_ids[s.start] for s in seqs], [s.start for s in seqs],
                         [s.block_ids for s in seqs])
        except GraphUnavailable as e:  # a capture failed: this step and the rest run eagerly, said once
            get_logger("moeflow.workers.runner").warning("decode runs eagerly from now on: %s", e)
            self.graphs = None
            return None

    def sample(self, batch: Batch, hidden: torch.Tensor) -> dict[str, SeqOutput]:
        """Sampling and logprobs from the final hidden states [T, H] of a batch."""
        out: dict[str, SeqOutput] = {}
        row = 0
        last_rows, last_ids = [], []
        for s in batch.seqs:
            st = self.requests[s.request_id]
            res = out[s.request_id] = SeqOutput()
            n_prompt = st.num_prompt if st.params.prompt_logprobs is not None else 0
            # rows whose next token is a known prompt token: positions start .. min(end, n_prompt - 1),
            # less those already sent
            first = max(0, st.prompt_logprobs_done - s.start)
            n_plp = max(0, min(s.start + s.num_tokens, n_prompt - 1) - s.start)
            st.prompt_logprobs_done = max(st.prompt_logprobs_done, s.start + n_plp)
            for a in range(first, n_plp, _LOGITS_ROWS):
                b = min(a + _LOGITS_ROWS, n_plp)
                logits = self.model.logits(hidden[row + a:row + b])
                nxt = torch.tensor(st.token_ids[s.start + a + 1:s.start + b + 1], dtype=torch.int64, device=self.device)
                res.prompt_logprobs += logprobs_of(logits, nxt, st.params.prompt_logprobs)
            if s.is_last_chunk:
                last_rows.append(row + s.num_tokens - 1)
                last_ids.append(s.request_id)
            row += s.num_tokens
        if last_rows:
            logits = self.model.logits(hidden[last_rows])  # [B, V]
            states = [self.requests[rid] for rid in last_ids]
            # NOTE: histories are copied only for rows with penalties (the only ones that read them)
            pen = [st.params.uses_penalties for st in states]
            tokens = sample_tokens(logits, [st.row() for st in states],
                                   [st.token_ids[:st.num_prompt] if u else () for st, u in zip(states, pen)],
                                   [st.token_ids[st.num_prompt:] if u else () for st, u in zip(states, pen)],
                                   [st.generator for st in states], self._default_gen)  # [B], on the device
            want = [i for i, st in enumerate(states) if st.params.logprobs is not None]
            ns = [states[i].params.logprobs for i in want]
            # NOTE: the step's one read back: the tokens, and the logprobs of the rows that asked, together
            packed = None
            if want:
                sel = torch.tensor(want, device=logits.device)
                packed = logprobs_packed(logits[sel], tokens[sel], max(ns))
            host = torch.cat([tokens.double()] + ([packed.flatten()] if want else [])).tolist()
            b = len(states)
            for rid, st, tok in zip(last_ids, states, host[:b]):
                out[rid].token_id = int(tok)
                st.token_ids.append(int(tok))
            if want:
                width = packed.shape[1]
                rows = [host[b + j * width:b + (j + 1) * width] for j in range(len(want))]
                for i, lp in zip(want, logprobs_unpacked(rows, ns)):
                    out[last_ids[i]].logprobs = lp
        return out

    def append_tokens(self, sampled: dict[str, int]) -> None:
        """Record tokens sampled elsewhere (a TP member that did not sample itself)."""
        for rid, tok in sampled.items():
            self.requests[rid].token_ids.append(tok)
