"""`jaxserve diagnose`: sample a server's metrics, walk the symptom -> layer -> tool tree.

The tree is the layer map of the design notes (hardware, kernel, memory/KV, scheduling,
parallelism, application, router), applied in this order to one window of metrics
(`Window`: the change of every counter and histogram between the first and the last of
several scrapes of `--metrics-port`, and the highest value each gauge took):

0. memory: preemptions in the window, or KV blocks in use near the pool's size. First,
   before start-up: the pool's size is fixed at start, so KV blocks running out is not
   an effect of compiling (a fresh-user trial had 26 preemptions named second, behind 9
   shapes still compiling);
1. start-up: step shapes still compiling in the background (the step budget is held to
   the compiled shapes, and the compile threads take CPU from the engine: effects the
   branches below would take for their own);
2. application: the frontend or the detokenizer sidecar near a whole core of CPU
   (`PROCESS_CORE_FULL`, `observability.process_cpu`: one Python process can use no
   more, and the streams queue behind it); the detokenizer lag (engine output ->
   frontend) or the frontend's event loop lag is a large part of the time per output
   token;
3. parallelism: the experts' load is unbalanced over the EP ranks (balancedness mean /
   max below `BALANCE_MIN`), with EPLB not re-placing them;
4. step agreement (several processes): the leader's step agreement latency (its slowest
   follower's median time from the leader's publish to having the step,
   `jaxserve_engine_step_agreement_seconds`) is `AGREEMENT_SHARE` or more of the
   leader's wall time per step. It ranks before the branches below because they would
   take its effect for their own: the followers start each step that late, the step's
   collectives wait for them (device time, low MBU), and slower steps queue requests;
5. router: a replica that does not serve (`jaxserve_replica_up` 0), or one much busier
   than the others (`jaxserve_replica_running`; both exist with several replicas);
6. scheduling, queue: high TTFT that is mostly queue time (arrival to first schedule),
   requests waiting: more requests than the engine runs at once;
7. application, shared host: with the engine loop saturated, the frontend, the
   sidecar and the host's other processes (a load client) take `STACK_SHARE` or more
   of the host's cores, CPU the engine does not get. After the queue (an engine asked
   for more requests than it runs at once queues them however fast it runs), before
   host gaps (an engine that loses cores shows longer host time);
8. scheduling, host gaps: a saturated engine loop whose steps spend most of their time
   on the host (scheduling, packing, output processing), not waiting for the device;
9. hardware / kernel: a saturated, device-bound engine with low MBU and MFU (the step
   time is not spent moving weights and KV at the device's bandwidth).

Every branch that holds is a `Finding` (the layer, the numbers that point there, the next
tool or flag); the first is the suspect. No finding: the server is healthy under the load
of the window (or idle: then it says that the window saw no requests). The thresholds are
constants below, chosen so a server that keeps up with its load names no layer.

`--from bench.json` reads a `jaxserve bench --out` file instead, with the client-visible
branches only (`observability.diagnose_bench`; the step agreement, like every other
server-side number, is not in it). No JAX here.
"""

from __future__ import annotations

from jaxserve.frontend.client_auth import ClientAuth
from jaxserve.observability.findings import Diagnosis, Finding
from jaxserve.observability.metrics_window import (  # noqa: F401 (importers of diagnose)
    Window,
    parse_exposition,
    sample,
    scrape,
)

# Thresholds of the tree (see the module docstring).
KV_FULL = 0.9  # KV blocks in use / usable blocks
LAG_SHARE = 0.3  # detokenizer or event-loop lag / TPOT
LAG_MIN_S = 0.02  # lag below this is never a finding
BALANCE_MIN = 0.8  # expert balancedness (mean / max load)
QUEUE_SHARE = 0.5  # queue time / TTFT
QUEUE_MIN_S = 0.1
# Step agreement / the leader's wall time per step (loop work / steps). The leader
# publishes a step before dispatching it, so some of the followers' delay hides behind
# its own dispatch; past a quarter of the step they start each step that much later and
# its collectives wait for them: up to 1 - 1 / 1.25 = 20% of the step rate lost. The
# channel's own floor (150-500 us p50 at 2-8 processes on a loaded 2-core host,
# `scripts/bench_step_agreement.py`) is a few % of a GPU decode step, so a share this
# high means a slow path between the processes, not the channel's normal cost.
AGREEMENT_SHARE = 0.25
HOT_REPLICA = 1.5  # busiest replica's running requests / the mean
# The frontend's and the sidecar's CPU, in cores over the window. Each is one Python
# process whose work runs on one thread (the frontend's asyncio loop, the sidecar's
# loop; the GIL), so it saturates at about one core: at 0.8 of one it has little room
# left for a burst, and the streams queue behind it.
PROCESS_CORE_FULL = 0.8
# Frontend + sidecar(s) + the host's other processes / its usable cores, with the
# engine loop saturated: what they take, the engine's host work (and on the CPU backend
# its XLA threads) does not get. A quarter is half a core of a 2-core host, where
# serving ran at 0.65-0.80x of the offline LLM.generate (issue 17 item 5); below it the
# engine's loss is small next to its own host time, which the host-gaps branch names.
STACK_SHARE = 0.25
BUSY = 0.9  # engine loop work / (work + wait): saturated
HOST_SHARE = 0.6  # host time / (host + device time) of the steps
MBU_LOW = 0.05  # device-bound and under 5% of the bandwidth peak
MAX_SECONDS = 3600.0
MIN_INTERVAL_S = 0.05  # between scrapes: each one reads and parses the whole /metrics page


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def diagnose_window(w: Window, source: str) -> Diagnosis:
    """Walk the tree (module docstring) over one window of a server's metrics."""
    finished = sum(v for k, v in w.last.items() if k.startswith("jaxserve_request_success_total"))
    finished -= sum(v for k, v in w.first.items() if k.startswith("jaxserve_request_success_total"))
    steps = w.delta("jaxserve_engine_steps_total")
    ttft = w.mean("jaxserve_time_to_first_token_seconds")
    tpot = w.mean("jaxserve_time_per_output_token_seconds")
    queue = w.mean("jaxserve_request_queue_time_seconds")
    out_tokens = w.delta("jaxserve_generation_tokens_total")
    summary: dict[str, float | str] = {
        "window_s": round(w.seconds, 1),
        "requests_finished": finished,
        "output_tok_s": _ratio(out_tokens, w.seconds),
    }
    if ttft is not None:
        summary["ttft_mean_s"] = ttft
    if tpot is not None:
        summary["tpot_mean_s"] = tpot
    if steps == 0 and finished == 0 and w.max("jaxserve_num_requests_running") == 0:
        note = "idle: no requests in the window; diagnose while the load runs (jaxserve bench)"
        return Diagnosis(source, [], summary, note)
    findings: list[Finding] = []

    # 0. memory
    total = w.gauge("jaxserve_kv_blocks_total")
    used_peak = w.max("jaxserve_kv_blocks_used")
    if w.delta("jaxserve_kv_blocks_used_max") > 0:  # a new high-water mark, between scrapes
        used_peak = max(used_peak, w.gauge("jaxserve_kv_blocks_used_max"))
    preempted = w.delta("jaxserve_num_preemptions_total")
    if preempted > 0 or (total and used_peak / total >= KV_FULL):
        findings.append(Finding(
            "memory (KV cache)", "KV blocks run out: requests are preempted and recomputed"
            if preempted else "the KV pool is near full",
            {"preemptions": preempted, "kv_blocks_used_peak": used_peak,
             "kv_blocks_total": total, "kv_used_peak_share": _ratio(used_peak, total)},
            "more KV blocks (--num-blocks, --gpu-memory-utilization, a smaller --block-size "
            "waste) or fewer sequences at once (--max-num-seqs); prefix caching shares "
            "prompts' blocks",
        ))  # fmt: skip

    # 1. start-up: background compilation still running
    pending = w.max("jaxserve_engine_warmup_pending_shapes")
    if pending > 0:
        findings.append(Finding(
            "start-up (background compilation)", "step shapes are still compiling: steps "
            "are held to the compiled shapes and the compile threads take the engine's CPU",
            {"warmup_pending_shapes": pending},
            "diagnose again after the log line 'all N step shapes compiled' (or once "
            "jaxserve_engine_warmup_pending_shapes is 0); --compile-all-at-start compiles "
            "every shape before serving",
        ))  # fmt: skip

    # 2. application: a process near a core, then lags (the CPU names a cause, a lag
    # its effect)
    wait = w.delta("jaxserve_engine_loop_wait_seconds_total")
    work = w.delta("jaxserve_engine_loop_work_seconds_total")
    busy = _ratio(work, wait + work)
    cpu = _process_cores(w)
    summary.update(cpu)
    cpu_finding = _cpu_finding(w, cpu, busy, out_tokens, shared=False) if cpu else None
    if cpu_finding is not None:
        findings.append(cpu_finding)
    detok = w.mean("jaxserve_detokenizer_lag_seconds")
    loop_lag = w.mean("jaxserve_frontend_event_loop_lag_seconds")
    per_token = tpot or 0.0
    for name, lag, what, nxt in (
        ("detokenizer_lag_mean_s", detok, "outputs wait in the detokenizer sidecar / IPC",
         "profile the sidecar (py-spy dump --pid of jaxserve.frontend.detokenizer_process), "
         "scripts/bench_detokenizer.py; check it has a core of its own"),
        ("event_loop_lag_mean_s", loop_lag, "the frontend's event loop runs late",
         "py-spy the frontend process: a handler blocks the loop (tokenizing huge prompts, "
         "synchronous work); fewer streams per frontend"),
    ):  # fmt: skip
        if lag is not None and lag >= LAG_MIN_S and lag >= LAG_SHARE * per_token:
            findings.append(Finding(
                "application (frontend / detokenizer)", what,
                {name: lag, "tpot_mean_s": per_token, "lag_share_of_tpot": _ratio(lag, per_token)},
                nxt,
            ))  # fmt: skip

    # 3. parallelism
    balance = w.labelled("jaxserve_expert_balancedness", "layer")
    rebalances = w.delta("jaxserve_eplb_rebalances_total")
    routed = w.delta("jaxserve_expert_routed_tokens_total")
    if balance and routed > 0:
        mean_b = sum(balance.values()) / len(balance)
        worst_layer, worst = min(balance.items(), key=lambda kv: kv[1])
        if mean_b < BALANCE_MIN:
            findings.append(Finding(
                "parallelism (expert load)", "the experts' load is unbalanced over the EP "
                "ranks: the busiest rank is the straggler of every MoE layer",
                {"expert_balancedness_mean": mean_b, "worst_layer": worst_layer,
                 "worst_balancedness": worst, "eplb_rebalances": rebalances},
                "--enable-eplb (and --num-redundant-experts for hot experts)" if rebalances == 0
                else "EPLB is on but cannot balance: more --num-redundant-experts, a shorter "
                "--eplb-step-interval",
            ))  # fmt: skip

    # 4. step agreement (the gauge is 0 in one process)
    agreement = w.gauge("jaxserve_engine_step_agreement_seconds")
    step_wall = _ratio(work, steps)
    if agreement > 0 and step_wall > 0 and agreement >= AGREEMENT_SHARE * step_wall:
        findings.append(Finding(
            "step agreement (CPU path between hosts)", "the followers get each step late: "
            "the leader's step message takes a large part of a step to reach the slowest "
            "follower, and every step's collectives wait for it",
            {"step_agreement_s": agreement, "step_wall_s": step_wall,
             "agreement_share_of_step": _ratio(agreement, step_wall),
             "publish_s_per_step": _ratio(w.delta(
                 "jaxserve_engine_coordination_time_seconds_total"), steps),
             "step_message_bytes": _ratio(w.delta(
                 "jaxserve_engine_coordination_bytes_total"), steps)},
            "keep the followers on the leader's host on the shared-memory ring (leave "
            "JAXSERVE_STEP_TRANSPORT unset or auto; the leader logs how many are on it); "
            "fewer processes per host (one process can drive all of a host's devices); "
            "check the network between hosts (latency, loss) and their clock sync (the "
            "time is measured with wall clocks); scripts/bench_step_agreement.py measures "
            "the channel alone",
        ))  # fmt: skip

    # 5. router (per-replica series only exist with several replicas)
    up = w.labelled("jaxserve_replica_up", "replica")
    down = sorted(r for r, v in up.items() if v < 1)
    if down:
        findings.append(Finding(
            "router (replicas)", f"{len(down)} of {len(up)} replicas do not serve "
            "(dead, stalled or starting): the others take all the traffic",
            {"replicas_down": ",".join(down), "replicas": len(up)},
            "the serve log names why each stopped (GetServerInfo's replicas[].reason); "
            "--restart-dead-replicas brings dead ones back",
        ))  # fmt: skip
    running = w.labelled("jaxserve_replica_running", "replica")
    if len(running) > 1:
        mean_r = sum(running.values()) / len(running)
        hot, hot_v = max(running.items(), key=lambda kv: kv[1])
        if mean_r > 0 and hot_v / mean_r >= HOT_REPLICA:
            findings.append(Finding(
                "router", f"replica {hot} is much busier than the others",
                {"hot_replica": hot, "running_there": hot_v, "running_mean": mean_r},
                "check the router's prefix-affinity vs load balance; more replicas",
            ))  # fmt: skip

    # 6. scheduling: queue
    waiting_peak = w.max("jaxserve_num_requests_waiting")
    running_peak = w.max("jaxserve_num_requests_running")
    if queue is not None and ttft and queue >= QUEUE_MIN_S and queue >= QUEUE_SHARE * ttft:
        findings.append(Finding(
            "scheduling (queue)", "TTFT is mostly queue time: more requests arrive than the "
            "engine runs at once",
            {"queue_time_mean_s": queue, "ttft_mean_s": ttft,
             "queue_share_of_ttft": _ratio(queue, ttft), "waiting_peak": waiting_peak,
             "running_peak": running_peak},
            "raise --max-num-seqs / --max-num-batched-tokens if the KV pool allows, or add "
            "replicas; jaxserve bench --max-concurrency N finds the knee",
        ))  # fmt: skip

    # 7. application, shared host (unless a process near a core was named already)
    if cpu and cpu_finding is None and busy >= BUSY and steps > 0:
        if (cpu_finding := _cpu_finding(w, cpu, busy, out_tokens, shared=True)) is not None:
            findings.append(cpu_finding)

    # 8-9. throughput with a busy engine: host gaps, or a slow device step
    host = w.delta("jaxserve_engine_host_time_seconds_total")
    device = w.delta("jaxserve_engine_device_time_seconds_total")
    host_share = _ratio(host, host + device)
    step_s = w.delta("jaxserve_engine_step_seconds_total")
    peak_bw = w.gauge("jaxserve_device_peak_bandwidth_bytes_per_second")
    peak_fl = w.gauge("jaxserve_device_peak_flops_per_second")
    mbu = _ratio(_ratio(w.delta("jaxserve_engine_model_bytes_total"), step_s), peak_bw)
    mfu = _ratio(_ratio(w.delta("jaxserve_engine_model_flops_total"), step_s), peak_fl)
    summary.update(engine_busy=busy, host_share=host_share, mbu=mbu, mfu=mfu)
    if queue is not None:
        summary["queue_time_mean_s"] = queue
    if agreement > 0:  # several processes
        summary["step_agreement_s"] = agreement
    if busy >= BUSY and steps > 0:
        if host_share >= HOST_SHARE:
            findings.append(Finding(
                "scheduling (host gaps)", "the engine is saturated and its steps spend most "
                "of their time on the host (schedule, pack, dispatch, outputs)",
                {"engine_busy": busy, "host_share": host_share,
                 "host_s_per_step": _ratio(host, steps),
                 "device_s_per_step": _ratio(device, steps)},
                "jaxserve profile (the host timeline shows which phase); keep async "
                "scheduling on; more decode steps per call (serve --num-decode-steps) "
                "amortize the host per token",
            ))  # fmt: skip
        elif peak_bw and mbu < MBU_LOW and mfu < MBU_LOW:
            findings.append(Finding(
                "hardware / kernel", "device-bound steps far below the device's bandwidth "
                "and FLOP peaks",
                {"mbu": mbu, "mfu": mfu, "step_s": _ratio(step_s, steps)},
                "jaxserve profile (the XLA trace: which kernel dominates); "
                "scripts/bench_kernels.py; larger batches (--max-num-seqs) raise MBU",
            ))  # fmt: skip
    return Diagnosis(source, findings, summary)


_CPU = "jaxserve_process_cpu_seconds_total"
_HOST_BUSY = "jaxserve_host_busy_cpu_seconds_total"


def _process_cores(w: Window) -> dict[str, float]:
    """Cores each serving process used over the window ({} from a server without the
    metric): frontend, detokenizer (all sidecars), engine (all engines), and, where the
    host's busy time is known, the other processes of the host (the busy cores less the
    serving processes'; an engine on another host makes it an underestimate)."""
    if f'{_CPU}{{process="frontend"}}' not in w.last:
        return {}
    cores = {
        f"{p}_cores": max(0.0, w.delta(f'{_CPU}{{process="{p}"}}')) / w.seconds
        for p in ("frontend", "detokenizer", "engine")
    }
    if _HOST_BUSY in w.last:
        busy = w.delta(_HOST_BUSY) / w.seconds
        cores["other_processes_cores"] = max(0.0, busy - sum(cores.values()))
    return cores


def _cpu_finding(
    w: Window, cpu: dict[str, float], busy: float, out_tokens: float, shared: bool
) -> Finding | None:
    """The application (CPU) branches: a process near a core (`PROCESS_CORE_FULL`), or
    `shared`: the processes beside a saturated engine (`STACK_SHARE`)."""
    # With several replicas, each sidecar's own (one of them may be the full one).
    prefix = "jaxserve_replica_detokenizer_cpu_seconds{"
    sidecars = [max(0.0, w.delta(k)) / w.seconds for k in w.last if k.startswith(prefix)]
    sidecar = max(sidecars, default=cpu["detokenizer_cores"])
    frontend = cpu["frontend_cores"]
    host_cores = w.gauge("jaxserve_host_usable_cores")
    takers = {"the frontend": frontend, "the detokenizer sidecar": cpu["detokenizer_cores"],
              "other processes (a load client on this host?)":
              cpu.get("other_processes_cores", 0.0)}  # fmt: skip
    share = _ratio(sum(takers.values()), host_cores)
    if not shared and max(frontend, sidecar) >= PROCESS_CORE_FULL:
        which = "frontend" if frontend >= sidecar else "detokenizer sidecar"
        symptom = (f"the {which} process is near a whole core, all one Python process "
                   "can run: the streams queue behind it")  # fmt: skip
    elif shared and share >= STACK_SHARE:
        most = max(takers, key=takers.__getitem__)
        symptom = ("processes beside the engine take a large share of the host's cores "
                   f"(most: {most}) while the engine loop is saturated: CPU the engine "
                   "does not get")  # fmt: skip
    else:
        return None
    numbers: dict[str, float | str] = {
        **cpu, "host_cores": host_cores, "non_engine_share_of_host": share,
        # CPU microseconds per output token: cores x window seconds / tokens
        "frontend_cpu_us_per_token": _ratio(1e6 * frontend * w.seconds, out_tokens),
        "detokenizer_cpu_us_per_token": _ratio(
            1e6 * cpu["detokenizer_cores"] * w.seconds, out_tokens),
        "engine_busy": busy,
    }  # fmt: skip
    if len(sidecars) > 1:
        numbers["detokenizer_max_cores"] = sidecar
    return Finding(
        "application (frontend / detokenizer CPU)", symptom, numbers,
        "fewer, larger stream messages: serve --stream-interval N (the frontend's and the "
        "sidecar's cost is per message, not per token); more cores, or the frontend on a "
        "host of its own (replicas as `jaxserve engine` on the engine hosts); run the load "
        "client (jaxserve bench) off the server's machine: it takes the same cores",
    )  # fmt: skip


def diagnose_server(
    address: str, seconds: float, interval_s: float = 0.5, auth: ClientAuth | None = None
) -> Diagnosis:
    """Sample ADDRESS/metrics (the server's --metrics-port; https:// when `auth` uses TLS,
    as a server with --tls-cert serves it) for `seconds` and walk the tree. Raises
    ValueError naming `seconds` out of (0, MAX_SECONDS] or a TLS file that cannot be
    read, OSError when the endpoint cannot be read."""
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds: must be in (0, {MAX_SECONDS:g}], got {seconds}")
    auth = auth or ClientAuth()
    window = sample(auth.url(address, "/metrics"), seconds, interval_s, context=auth.ssl_context())
    return diagnose_window(window, f"{address}, {seconds:g} s window")
