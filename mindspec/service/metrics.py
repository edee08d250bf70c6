"""Prometheus metrics of the service (served on ServerConfig.metricsPort at /metrics)."""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServiceMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mindspec_requests", "Finished requests by status", ["status"], registry=r)
        self.ttft = Histogram("mindspec_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("mindspec_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mindspec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("mindspec_generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge("mindspec_num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("mindspec_num_requests_waiting", "Sequences waiting", registry=r)
        self.blocks_used = Gauge("mindspec_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_free = Gauge("mindspec_kv_blocks_free", "KV cache blocks free", registry=r)
        self.drafted = Counter("mindspec_spec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("mindspec_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_pos = Counter("mindspec_spec_accepted_tokens_per_position", "Draft tokens accepted by position",
                                    ["position"], registry=r)
        self.mean_accepted = Gauge("mindspec_spec_mean_accepted_length", "Tokens per decode step (accepted + 1)", registry=r)
        self.compiled_steps = Gauge("mindspec_compiled_decode_steps", "Decode steps run as compiled packages (cpu)",
                                    registry=r)
        self.packages = Gauge("mindspec_compiled_step_packages", "Compiled step packages by how they were obtained",
                              ["state"], registry=r)
        self.step_host_work = Gauge("mindspec_decode_step_host_work",
                                    "Per batch-1 decode step, measured after warm-up: ops launched outside compiled "
                                    "steps or graphs, host synchronisations, host-to-device copies", ["kind"], registry=r)
        self.cache_queries = Counter("mindspec_prefix_cache_queries", "Prefix cache lookups at admission: prompt "
                                     "tokens (unit=tokens) and whole prompt blocks (unit=blocks) asked for",
                                     ["unit"], registry=r)
        self.cache_hits = Counter("mindspec_prefix_cache_hits", "Prefix cache lookups: tokens and blocks found cached",
                                  ["unit"], registry=r)
        self.cache_hit_rate = Gauge("mindspec_prefix_cache_hit_rate", "Found / asked for since start", ["unit"],
                                    registry=r)
        self.blocks_cached_idle = Gauge("mindspec_kv_blocks_cached_idle",
                                        "Cached KV blocks no request holds (counted as free; evicted LRU)", registry=r)
        self._lock = threading.Lock()
        self._seen = (0, 0, ())
        self._seen_cache = (0, 0, 0, 0)

    def observe_engine(self, engine) -> None:
        """Called by the engine thread after each step."""
        bm = engine.block_manager
        self.running.set(engine.scheduler.num_running)
        self.waiting.set(engine.scheduler.num_waiting)
        self.blocks_free.set(bm.num_free_blocks)
        self.blocks_used.set(bm.num_usable_blocks - bm.num_free_blocks)
        s = engine.spec_stats
        with self._lock:
            drafted, accepted, per_pos = self._seen
            self.drafted.inc(s.num_draft_tokens - drafted)
            self.accepted.inc(s.num_accepted_tokens - accepted)
            for pos, count in enumerate(s.accepted_per_position):
                before = per_pos[pos] if pos < len(per_pos) else 0
                self.accepted_pos.labels(position=str(pos + 1)).inc(count - before)
            self._seen = (s.num_draft_tokens, s.num_accepted_tokens, tuple(s.accepted_per_position))
        if s.num_steps:
            self.mean_accepted.set(s.mean_accepted_length)
        if bm.prefix_cache is not None:
            self._observe_prefix_cache(bm)
        compiled = engine.model_wrapper.compiled
        if compiled is not None:
            st = compiled.stats
            self.compiled_steps.set(st.calls)
            for state, n in (("compiled", st.compiled), ("loaded", st.loaded), ("failed", st.failed),
                             ("compiling", st.compiling)):
                self.packages.labels(state=state).set(n)
        for kind, value in (engine.step_accounting or {}).items():
            if kind != "steps":
                self.step_host_work.labels(kind=kind).set(value)

    def _observe_prefix_cache(self, bm) -> None:
        st = bm.prefix_cache.stats
        now = (st.query_tokens, st.hit_tokens, st.query_blocks, st.hit_blocks)
        with self._lock:
            q_tok, h_tok, q_blk, h_blk = (a - b for a, b in zip(now, self._seen_cache))
            self._seen_cache = now
        self.cache_queries.labels(unit="tokens").inc(q_tok)
        self.cache_hits.labels(unit="tokens").inc(h_tok)
        self.cache_queries.labels(unit="blocks").inc(q_blk)
        self.cache_hits.labels(unit="blocks").inc(h_blk)
        self.cache_hit_rate.labels(unit="tokens").set(st.token_hit_rate)
        self.cache_hit_rate.labels(unit="blocks").set(st.block_hit_rate)
        self.blocks_cached_idle.set(bm.num_idle_blocks)

    def request_finished(self, status: str, prompt_tokens: int = 0, output_tokens: int = 0,
                         ttft: float | None = None, total: float | None = None) -> None:
        self.requests.labels(status=status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
            if total is not None and output_tokens > 1:
                self.tpot.observe((total - ttft) / (output_tokens - 1))

    def request_aborted(self) -> None:
        self.requests.labels(status="aborted").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
