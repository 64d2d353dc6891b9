"""A fleet simulator on a virtual clock, driving backfill's own capacity controller.

A discrete-event simulation (no sleeping, no threads) of an inference fleet: per worker vLLM's
scheduler (continuous batching, `max_num_seqs`, `max_num_batched_tokens`, chunked prefill, KV
blocks from a byte budget and the bytes per token, preemption, interactive before batch), the
prefill/decode split or the aggregated fleet, a host-memory tier for evicted prefix blocks, and
a step time from what each step holds (`backfill.sim.perf`). It serves the Prometheus text the
real frontend and workers serve, and the real controller (`scheduler.capacity`), admission,
shedding and escalation steer the batch side on it (`backfill.sim.control`); `backfill.sim.oracle`
searches, knowing the future, for the largest batch limit per window that keeps the interactive
SLO. See docs/simulator.md.
"""
