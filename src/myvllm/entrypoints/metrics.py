"""GET /metrics: the server's state and latencies in Prometheus text format.

vLLM's metric names under our prefix, so dashboards written for vLLM read ours:

    myvllm:num_requests_running          gauge      sequences in the running queue
    myvllm:num_requests_waiting          gauge      sequences waiting for a prefill
    myvllm:kv_cache_usage_perc           gauge      KV-cache blocks in use, 0..1
    myvllm:prefix_cache_queries_total    counter    prompt tokens looked up in the prefix cache
    myvllm:prefix_cache_hits_total       counter    of those, tokens found there
    myvllm:prompt_tokens_total           counter
    myvllm:generation_tokens_total       counter
    myvllm:request_success_total         counter    by finished_reason (stop, length, abort)
    myvllm:time_to_first_token_seconds   histogram  arrival -> first token at the server
    myvllm:inter_token_latency_seconds   histogram  between two outputs of one request
    myvllm:e2e_request_latency_seconds   histogram  arrival -> last token
    myvllm:spec_decode_num_drafts_total             counter  speculative decoding: rows
                                                             that verified proposals
    myvllm:spec_decode_num_draft_tokens_total       counter  tokens proposed
    myvllm:spec_decode_num_accepted_tokens_total    counter  of those, accepted
    myvllm:spec_decode_num_accepted_tokens_per_pos_total  counter  by proposal position

The mean accepted length is 1 + num_accepted_tokens / num_drafts (vLLM's reading of the same
counters); the spec_decode counters appear only with speculative decoding on.

"In use" counts blocks held by a request; free blocks that still hold a cached prefix count
as free (they are handed out again when needed), as in vLLM. The core reports the queues as
each step starts (EngineCore.on_step_start) and again after it, so a long prefill shows as
running, its blocks as used, while its step runs.

Each server owns its own registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from myvllm.serving.async_llm import StatLogger
from myvllm.serving.core_messages import SpecDecodeCounts

# Without this every counter and histogram gets a second series, *_created (a timestamp),
# that doubles the output and that nobody reads (vLLM turns it off the same way).
prometheus_client.disable_created_metrics()

# vLLM's buckets: latencies on a GPU range from milliseconds to minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PrometheusStatLogger(StatLogger):
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"myvllm:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"myvllm:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"myvllm:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running queue.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a prefill.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter("myvllm:request_success", "Requests finished, by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two outputs of one request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, end to end.",
                             E2E_BUCKETS)
        # Speculative decoding: made at its first report (absent when it is off).
        self._spec: dict[str, Any] | None = None
        self._spec_per_pos: Counter | None = None
        self._spec_totals: dict[str, int] = {}

    def record_scheduler(self, num_running: int, num_waiting: int,
                         kv_cache_usage: float) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_cache_usage)

    def record_first_token(self, time_to_first_token: float, num_prompt_tokens: int,
                           num_cached_tokens: int) -> None:
        self.ttft.observe(time_to_first_token)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prefix_queries.inc(num_prompt_tokens)
        self.prefix_hits.inc(num_cached_tokens)

    def record_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if inter_token_latency is not None:
            self.itl.observe(inter_token_latency)

    def record_finished(self, finish_reason: str, e2e_latency: float) -> None:
        self._success.labels(self._model_name, finish_reason).inc()
        self.e2e.observe(e2e_latency)

    def record_spec_decode(self, counts: SpecDecodeCounts) -> None:
        # The core sends totals; a counter only goes up, by what is new since the last.
        if self._spec is None:
            r, labels = self.registry, ["model_name"]
            self._spec = {
                name: Counter(f"myvllm:spec_decode_{name}", doc, labels,
                              registry=r).labels(self._model_name)
                for name, doc in (("num_drafts", "Rows that verified proposals."),
                                  ("num_draft_tokens", "Tokens proposed."),
                                  ("num_accepted_tokens", "Proposed tokens accepted."))}
            self._spec_per_pos = Counter("myvllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Proposed tokens accepted, by position.",
                                         ["model_name", "position"], registry=r)
        totals = {"num_drafts": counts.num_drafts,
                  "num_draft_tokens": counts.num_draft_tokens,
                  "num_accepted_tokens": counts.num_accepted_tokens}
        for name, total in totals.items():
            self._spec[name].inc(total - self._spec_totals.get(name, 0))
            self._spec_totals[name] = total
        per_pos = self._spec_per_pos
        assert per_pos is not None
        for position, total in enumerate(counts.accepted_per_position):
            key = f"pos{position}"
            per_pos.labels(self._model_name, str(position)).inc(
                total - self._spec_totals.get(key, 0))
            self._spec_totals[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
