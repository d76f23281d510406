"""One window of a deployment's live load, accumulated step by step into the controller's ``Sample``
(``autoscale.py``): the engine's autoscaler (``engine/autoscaler.py``) and the simulator's elastic
systems (``sim/elastic_afd.py``) feed it the same way, so both hand the controller the same numbers
for the same steps. Pure Python.

TPOT is per request, as ``vllm bench serve`` reports it: (last token - first token) / (tokens - 1),
for the requests that finished in the window with two or more tokens; TTFT first token - arrival,
for those that finished in it; the window's p90 of each.
"""
from __future__ import annotations

from moeflow.scheduler.autoscale import Sample
from moeflow.scheduler.autoscale_ep import EpSample
from moeflow.scheduler.autoscale_pd import PdSample


class LoadWindow:
    def __init__(self, t0_s: float):
        self.t0_s = t0_s
        self.busy_s = self.wait_s = 0.0  # summed over the attention instances
        self.tpots: list[float] = []  # of the requests that finished in the window
        self.ttfts: list[float] = []
        self._live: dict[str, tuple[float, int, float]] = {}  # request -> (first token, tokens, last token)

    def step(self, busy_s: float, wait_s: float) -> None:
        """The instances computed ``busy_s`` and were blocked on the FFN side ``wait_s`` (summed)."""
        self.busy_s += busy_s
        self.wait_s += wait_s

    def token(self, request_id: str, now_s: float) -> None:
        first, n, _ = self._live.get(request_id, (now_s, 0, now_s))
        self._live[request_id] = (first, n + 1, now_s)

    def finished(self, request_id: str, arrival_s: float | None = None) -> None:
        """``arrival_s``: on the same clock as the tokens' times (its TTFT counts)."""
        if request_id not in self._live:
            return
        first, n, last = self._live.pop(request_id)
        self.request(first, last, n, arrival_s)

    def request(self, first_s: float, last_s: float, tokens: int, arrival_s: float | None = None) -> None:
        """A request finished in the window: its first and last token's times and its token count (where
        the tokens are not seen one by one: the simulator's pd records)."""
        if tokens > 1:
            self.tpots.append((last_s - first_s) / (tokens - 1))
        if arrival_s is not None:
            self.ttfts.append(first_s - arrival_s)

    def due(self, now_s: float, sample_s: float) -> bool:
        return now_s - self.t0_s >= sample_s

    def sample(self, now_s: float, attention: int, ffn: int, queue: int, free_kv_blocks: int,
               kv_blocks: int, oldest_unanswered_s: float | None = None) -> Sample:
        """The window up to ``now_s`` with the deployment's members, queue, KV room and the arrival of
        its oldest request without a first token (``oldest_unanswered``) now; the next window starts here."""
        window = max(now_s - self.t0_s, 1e-9)
        s = Sample(now_s, attention, ffn, attn_busy=self.busy_s / (window * attention),
                   attn_wait=self.wait_s / (window * attention), tpot_p90_s=_p90(self.tpots), queue=queue,
                   kv_free=free_kv_blocks / max(1, kv_blocks), ttft_p90_s=_p90(self.ttfts),
                   queue_wait_s=0.0 if oldest_unanswered_s is None else max(0.0, now_s - oldest_unanswered_s))
        self.t0_s, self.busy_s, self.wait_s, self.tpots, self.ttfts = now_s, 0.0, 0.0, [], []
        return s


class PdWindow(LoadWindow):
    """A pd deployment's window (``autoscale_pd.py``): ``step`` takes the prefill processes' compute
    seconds, ``decoding`` the number of requests on the decode side each time it changes (or is looked
    at), so the window has its time-weighted mean."""

    def __init__(self, t0_s: float):
        super().__init__(t0_s)
        self._decoding, self._since, self._area = 0, t0_s, 0.0

    def decoding(self, n: int, now_s: float) -> None:
        self._area += self._decoding * max(0.0, now_s - self._since)
        self._decoding, self._since = n, now_s

    def sample_pd(self, now_s: float, prefill: int, decode: int, prefill_processes: int, queue: int,
                  handoffs_waiting: int, free_kv_blocks: int, kv_blocks: int,
                  oldest_unanswered_s: float | None = None) -> PdSample:
        """The window up to ``now_s``: ``prefill_processes`` per prefill instance, the decode side's KV
        blocks; the next window starts here."""
        self.decoding(self._decoding, now_s)
        window = max(now_s - self.t0_s, 1e-9)
        s = PdSample(now_s, prefill, decode, prefill_busy=self.busy_s / (window * prefill * prefill_processes),
                     decode_batch=self._area / (window * decode), tpot_p90_s=_p90(self.tpots),
                     ttft_p90_s=_p90(self.ttfts), queue=queue, handoffs_waiting=handoffs_waiting,
                     decode_kv_free=free_kv_blocks / max(1, kv_blocks),
                     queue_wait_s=0.0 if oldest_unanswered_s is None else max(0.0, now_s - oldest_unanswered_s))
        self.t0_s, self.busy_s, self.wait_s, self.tpots, self.ttfts, self._area = now_s, 0.0, 0.0, [], [], 0.0
        return s


class EpWindow(PdWindow):
    """A deployment of ranks' window (``autoscale_ep.py``): ``step`` takes the ranks' compute seconds,
    ``decoding`` the requests decoding on them."""

    def sample_ep(self, now_s: float, ranks: int, processes: int, queue: int, free_kv_blocks: int, kv_blocks: int,
                  oldest_unanswered_s: float | None, imbalance: tuple[float, ...]) -> EpSample:
        """The window up to ``now_s``: ``processes`` per rank, the expert load's imbalance at R - 1, R, R + 1, ...;
        the next window starts here."""
        p = self.sample_pd(now_s, ranks, ranks, processes, queue, 0, free_kv_blocks, kv_blocks, oldest_unanswered_s)
        return EpSample(now_s, ranks, p.decode_batch, p.tpot_p90_s, p.ttft_p90_s, queue, p.decode_kv_free,
                        p.queue_wait_s, p.prefill_busy, imbalance)


def oldest_unanswered(pool) -> float | None:
    """The arrival of the oldest request without a first token: queued, or placed on a group that has
    not computed its prompt yet (a group's own backlog, which the pool's waiting queue does not show)."""
    return min((r.arrival_s for r in pool.requests.values() if not r.output_token_ids), default=None)


def _p90(xs: list[float]) -> float | None:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else None
