"""Observability, one module a concern: the typed stats records that cross processes
(`stats`), the Prometheus registry the frontend exports on --metrics-port (`metrics`), the
frontend's per-request latencies (`request_timing`), the engine step's cost model and
device peaks (`step_cost`, `peaks`: MBU/MFU), the frontend event-loop lag (`loop_lag`),
`jaxserve profile` (`profile`, `profile_rpc`) and `jaxserve diagnose` (`diagnose`, `cli`).
The frontend-side modules import no JAX."""
