"""`jaxserve bench`: load a running server with a dataset and report its serving metrics.

    jaxserve bench --server 127.0.0.1:50051 --dataset random --input-len 128 --output-len 64 \
        --num-prompts 200 --request-rate 8 --slo ttft=500,tpot=50 --out b.json --plot b.png

The traffic flags are `vllm bench serve`'s (--request-rate, --burstiness,
--max-concurrency, --num-warmups, --ignore-eos); the length flags are shared by the
datasets (--input-len, --output-len, ...) where vLLM has one set per dataset. Prints
the results table (report.py) to stdout, progress and errors to stderr. Before any
request the server is asked for its model (gRPC GetServerInfo, HTTP GET /v1/models); a
server that does not answer (nothing listens, the engine is starting or dead, a wrong
key) ends the run with one line naming --server and the cause. Exit status: 0, 1 if the
server cannot be reached or failed the warm-up or every request (one line, no table),
2 for a bad flag (its name in the message).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
from pathlib import Path

from jaxserve.benchmark.probe import ServerUnreachableError, ask_server
from jaxserve.benchmark.server_warmup import wait_for_warmup
from jaxserve.config import DEMO_MODEL_DIR, ServerConfig
from jaxserve.flag_types import MAX_TIMEOUT_S, check_writable
from jaxserve.frontend import client_auth, server_address

MAX_PROMPTS = 1_000_000  # --num-prompts: requests (or conversations) one run builds


def add_subparser(sub: argparse._SubParsersAction) -> None:
    """Register `jaxserve bench` on the CLI's subparsers."""
    b = sub.add_parser(
        "bench",
        help="benchmark a running server (vllm bench serve style)",
        description=__doc__.splitlines()[0],
    )
    b.add_argument(
        "--backend",
        choices=["grpc", "http"],
        default="grpc",
        help="grpc: Generate; http: streamed POST /v1/completions (OpenAI API)",
    )
    b.add_argument(
        "--server",
        type=server_address.server_arg,
        default=f"{ServerConfig().host}:{ServerConfig().port}",
        help="HOST:PORT (http: also a base URL); default %(default)s",
    )
    b.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="model folder whose tokenizer.json builds the prompts (default: the "
        "server's model when this machine has its folder or Hub id; the demo's for the "
        "demo model; any other model needs this flag)",
    )
    d = b.add_argument_group("dataset")
    d.add_argument(
        "--dataset",
        default="random",
        choices=["random", "shared-prefix", "sharegpt", "multi-turn", "text"],
    )
    d.add_argument(
        "--dataset-path",
        metavar="FILE",
        help="sharegpt: a ShareGPT JSON file; text: one prompt a line; "
        "multi-turn: a ShareGPT file (default: synthetic conversations)",
    )
    d.add_argument(
        "--num-prompts",
        type=int,
        default=100,
        help="requests to send (multi-turn: conversations); default %(default)s",
    )
    d.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="random: prompt tokens; multi-turn: tokens per user turn",
    )
    d.add_argument(
        "--output-len",
        type=int,
        help="max_tokens per request (default 64; sharegpt: the model turn's length)",
    )
    d.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len*(1-r), len*(1+r)]",
    )
    d.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    d.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: own tokens")
    d.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: prefixes")
    d.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per conversation")
    d.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    t = b.add_argument_group("traffic")
    t.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests (sessions) per second, Poisson; inf: all at once (default)",
    )
    t.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, < 1 burstier, > 1 steadier",
    )
    t.add_argument("--max-concurrency", type=int, help="most requests in flight")
    t.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent first")
    t.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    t.add_argument("--ignore-eos", action="store_true", help="every request runs to max_tokens")
    t.add_argument("--timeout", type=float, default=600.0,
                   help=f"seconds per request, at most {MAX_TIMEOUT_S:g}")  # fmt: skip
    t.add_argument(
        "--warmup-timeout", type=float, default=900.0, metavar="SECONDS",
        help="gRPC: wait at most this long for the server's background compilation to end "
        "before the run (jaxserve.benchmark.server_warmup); 0: run at once (default 900)",
    )  # fmt: skip
    r = b.add_argument_group("report")
    r.add_argument("--slo", help="goodput SLOs in ms, e.g. ttft=500,tpot=50 (also e2el)")
    r.add_argument("--percentiles", default="50,90,99", help="latency percentiles to report")
    r.add_argument("--out", metavar="FILE.json", help="write the config, summary and requests")
    r.add_argument("--plot", metavar="FILE.png", help="latency histograms, throughput over time")
    r.add_argument("--label", default="", help="a title for the table, JSON and plot")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    client_auth.add_flags(b)
    b.set_defaults(func=cmd_bench)


def _error(message: str, status: int = 2) -> int:
    print(f"jaxserve bench: error: {message}", file=sys.stderr)
    return status


def _check_flags(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first bad flag. An optional package a flag needs is
    checked here, before any output (the progress bar) and any request: not at the run
    (aiohttp: the HTTP backend) or after it (matplotlib: the plot)."""
    if args.backend == "http":
        _check_installed("--backend http", "aiohttp")
    else:  # a gRPC target: no URL, a port of its own (else: "target: ..." from the client)
        server_address.check("--server", args.server)
    if args.plot:
        _check_installed("--plot", "matplotlib")
        check_writable("--plot", args.plot)
    if args.out:
        check_writable("--out", args.out)
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        raise ValueError(f"--num-prompts: must be in [1, {MAX_PROMPTS}], got {args.num_prompts}")
    if args.dataset in ("sharegpt", "text") and not args.dataset_path:
        raise ValueError(f"--dataset-path: required by --dataset {args.dataset}")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN too
        raise ValueError(f"--timeout: must be in (0, {MAX_TIMEOUT_S:g}], got {args.timeout}")
    if not args.warmup_timeout >= 0:  # NaN too
        raise ValueError(f"--warmup-timeout: must be >= 0, got {args.warmup_timeout}")
    if args.seed < 0:  # numpy's generators take none: "expected non-negative integer"
        raise ValueError(f"--seed: must be >= 0, got {args.seed}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups: must be >= 0, got {args.num_warmups}")
    if not args.temperature >= 0:  # NaN too
        raise ValueError(f"--temperature: must be >= 0, got {args.temperature}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate: must be > 0 (inf: all at once), got {args.request_rate}")
    if not 0 < args.burstiness < math.inf:
        raise ValueError(f"--burstiness: must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency: must be >= 1, got {args.max_concurrency}")


def _load_tokenizer(folder: str):
    """`load_tokenizer(folder)`; raises ValueError naming --tokenizer for a folder without
    a readable tokenizer.json (it said "--dataset-path: model: no tokenizer.json in ...")."""
    from jaxserve.frontend.tokenizer import load_tokenizer

    try:
        return load_tokenizer(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer: {str(e).removeprefix('model: ')}") from None


def _check_installed(flag: str, module: str) -> None:
    """Raises ValueError("FLAG: needs MODULE (pip install ...)") when `module` cannot be
    found (the `bench` extra installs every optional package of `jaxserve bench`)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{flag}: needs {module} (pip install 'jaxserve[bench]')")


_ASK = object()  # _tokenizer_dir: ask the server for its model


def _tokenizer_dir(args: argparse.Namespace, served: str | None | object = _ASK) -> str:
    """The folder whose tokenizer.json builds the prompts: --tokenizer; else the server's
    model when this machine has it (the served name as a folder, or a Hugging Face id
    `hub.resolve_model` finds); else the demo's when the server serves the demo model.
    served: the served model's name when already asked (`probe.ask_server`), None for an
    unreachable server; by default the server is asked here.
    Raises ValueError naming --tokenizer for any other model: prompts built with another
    model's tokenizer would carry wrong token ids and counts."""
    if args.tokenizer:
        return args.tokenizer
    name = _served_model(args) if served is _ASK else served
    if name is None:  # unreachable now: the run's own requests will say so
        return str(DEMO_MODEL_DIR)
    if (Path(name) / "tokenizer.json").is_file():
        return name
    if name == DEMO_MODEL_DIR.name:
        return str(DEMO_MODEL_DIR)
    from jaxserve.hub import looks_like_repo_id, resolve_model

    if looks_like_repo_id(name):
        try:
            folder = resolve_model(name)
        except ValueError:
            folder = ""
        if folder and (Path(folder) / "tokenizer.json").is_file():
            return folder
    raise ValueError(
        f"--tokenizer: the server serves {name!r}, whose tokenizer this machine cannot "
        "find; pass --tokenizer MODEL_DIR (the served model's folder)"
    )


def _served_model(args: argparse.Namespace) -> str | None:
    """The model name the server reports (`probe.ask_server`), None when it cannot be asked."""
    try:
        return ask_server(args.server, args.backend, client_auth.from_args(args)).model
    except Exception:  # noqa: BLE001 - any failure here: the caller decides
        return None


def _pending_shapes(args: argparse.Namespace, auth) -> int | None:
    """The server's step shapes still compiling (gRPC GetServerInfo), None when it cannot
    be asked (the HTTP backend, a server that is down: the run's requests say why)."""
    if args.backend != "grpc":
        return None
    try:
        from jaxserve.frontend.client import JaxserveClient

        with JaxserveClient(args.server, **auth.client_kwargs()) as c:
            return c.server_info(timeout=10).warmup_pending_shapes
    except Exception:  # noqa: BLE001 - see above
        return None


def build_dataset(args: argparse.Namespace, tokenizer):
    """The sessions the flags ask for. Raises ValueError naming a bad flag, OSError for
    an unreadable --dataset-path."""
    from jaxserve.benchmark import datasets as ds

    out_len = args.output_len
    if out_len is not None and out_len < 1:
        raise ValueError(f"--output-len: must be >= 1, got {out_len}")
    try:
        if args.dataset == "random":
            return ds.random_dataset(
                tokenizer, args.num_prompts, input_len=args.input_len,
                output_len=out_len or 64, range_ratio=args.range_ratio, seed=args.seed,
            )  # fmt: skip
        if args.dataset == "shared-prefix":
            return ds.shared_prefix_dataset(
                tokenizer, args.num_prompts, prefix_len=args.prefix_len,
                suffix_len=args.suffix_len, output_len=out_len or 64,
                num_prefixes=args.num_prefixes, seed=args.seed,
            )  # fmt: skip
        if args.dataset == "sharegpt":
            return ds.sharegpt_dataset(
                tokenizer, args.dataset_path, args.num_prompts, output_len=out_len,
                seed=args.seed,
            )  # fmt: skip
        if args.dataset == "multi-turn":
            return ds.multi_turn_dataset(
                tokenizer, args.num_prompts, num_turns=args.num_turns,
                input_len=args.input_len, output_len=out_len or 64,
                path=args.dataset_path, seed=args.seed,
            )  # fmt: skip
        return ds.text_file_dataset(
            tokenizer, args.dataset_path, args.num_prompts, output_len=out_len or 64
        )
    except ValueError as e:  # "name: why" -> "--name: why"
        field, sep, why = str(e).partition(": ")
        raise ValueError(f"--{field.replace('_', '-')}: {why}" if sep else str(e)) from None


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from jaxserve.benchmark import client, report
    from jaxserve.benchmark.backends import Sampling, make_backend

    try:
        auth = client_auth.from_args(args)
        auth.ssl_context()  # an unreadable PEM file is a usage error, before any request
    except ValueError as e:
        return _error(client_auth.flag_error(e))
    try:
        _check_flags(args)
        slo = report.parse_slo(args.slo) if args.slo else None
        percentiles = report.parse_percentiles(args.percentiles)
        # A --tokenizer folder is checked before the server is asked (a usage error).
        tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
        try:
            # One question: the model (for the tokenizer) and, over gRPC, the step shapes
            # still compiling (the warm-up wait's first count).
            served = ask_server(args.server, args.backend, auth)
        except ServerUnreachableError as e:
            return _error(str(e), 1)
        tokenizer_dir = _tokenizer_dir(args, served.model)
        if tokenizer is None:
            tokenizer = _load_tokenizer(tokenizer_dir)
        sessions = build_dataset(args, tokenizer)
    except ValueError as e:
        return _error(str(e).replace("slo:", "--slo:").replace("percentiles:", "--percentiles:"))
    except OSError as e:
        return _error(f"--dataset-path: {e}")
    warmup = wait_for_warmup(
        lambda: _pending_shapes(args, auth), args.warmup_timeout,
        first=served.warmup_pending_shapes,
    )  # fmt: skip
    n_requests = sum(len(s.turns) for s in sessions)
    load_before = os.getloadavg()
    bar = tqdm(total=n_requests, disable=args.no_progress, file=sys.stderr, unit="req")

    async def go():
        async with make_backend(args.backend, args.server, args.timeout, auth) as backend:
            return await client.run(
                backend, sessions,
                sampling=Sampling(temperature=args.temperature, ignore_eos=args.ignore_eos),
                request_rate=args.request_rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
                seed=args.seed, on_done=lambda _: bar.update(1),
            )  # fmt: skip

    try:
        result = asyncio.run(go())
    except RuntimeError as e:
        return _error(str(e), 1)
    finally:
        bar.close()
    metrics = report.compute_metrics(
        result.outputs, result.duration, slo=slo, percentiles=percentiles
    )
    if not metrics["completed"]:  # a table of zeros says nothing: the cause does
        first = next((o.error for o in result.outputs if o.error), "no request was sent")
        return _error(f"every request failed ({len(result.outputs)}), the first: {first}", 1)
    load_after = os.getloadavg()
    print(report.format_table(metrics, percentiles, args.label))
    print(f"load average before {_load(load_before)}, after {_load(load_after)}; "
          f"{platform.machine()} x{os.cpu_count()} cores")  # fmt: skip
    if failed := [o.error for o in result.outputs if not o.success]:
        print(f"{len(failed)} requests failed, the first: {failed[0]}", file=sys.stderr)
    timeline = report.timeline(result.outputs, result.t0, result.duration)
    if args.out:
        doc = {
            "label": args.label,
            "tokenizer_dir": tokenizer_dir,
            "config": {
                k: _json_number(v) for k, v in vars(args).items() if k not in ("func", "api_key")
            },
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "load_avg_before": load_before,
                "load_avg_after": load_after,
            },  # fmt: skip
            "server_warmup": warmup,
            "metrics": metrics,
            "timeline": timeline,
            "requests": report.per_request_records(result.outputs, result.t0),
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, allow_nan=False))
        print(f"wrote {out}")
    if args.plot:
        try:
            from jaxserve.benchmark.plot import write_plot

            print(f"wrote {write_plot(args.plot, result.outputs, timeline, args.label)}")
        except RuntimeError as e:
            return _error(str(e), 1)
    return 0


def _load(avg) -> str:
    return " ".join(f"{x:.2f}" for x in avg)


def _json_number(value):
    """inf (--request-rate's default) as the string "inf": JSON has no infinity."""
    return "inf" if isinstance(value, float) and math.isinf(value) else value
