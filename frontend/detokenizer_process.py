"""The detokenizer sidecar: engine token ids in, text deltas out, stop strings owned here.

    python -m jaxserve.frontend.detokenizer_process --model DIR --detokenizer-input ipc://...\
        --frontend-input ipc://... --engine-input ipc://... --parent-pid N

`OutputProcessor` is the logic (pure, testable without sockets): one
`IncrementalDetokenizer` per request, learned from the request's first engine output.
When a stop string matches, the request's final TextOutput goes to the frontend at once
and an AbortRequest goes to the engine; the engine's later outputs for that request
(tokens already in flight, then its final "abort") are dropped. The main loop around it
forwards EngineStats in order with the outputs, with this process's CPU seconds written
into them (`EngineCounters.detokenizer_cpu_s`: `jaxserve_process_cpu_seconds_total`).

One request's bad data (a token id the tokenizer cannot decode, a malformed `first`)
fails only that request: its final TextOutput has finish_reason "error" and an error
starting with "detokenizer:", the engine is told to abort it, and every other stream goes
on. A frame that does not decode is logged (one line) and dropped.

Test hook: the environment variable `JAXSERVE_TEST_DETOKENIZER_DELAY_S` (seconds, default
0) makes the sidecar sleep that long before each batch of engine outputs, an artificial
slow detokenizer: `jaxserve diagnose` must then name the application layer (its scenario
test, tests/test_diagnose_scenarios.py). Never set it in production. Each TextOutputs
carries its EngineOutputs' `sent_time` (`engine_time`): the frontend's detokenizer lag.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass

import zmq
from tokenizers import Tokenizer

from jaxserve.engine.control import HEARTBEAT_INTERVAL_S
from jaxserve.frontend.detokenizer import IncrementalDetokenizer
from jaxserve.frontend.tokenizer import load_tokenizer
from jaxserve.ipc import (
    AbortRequest,
    EngineOutputs,
    EngineStats,
    Heartbeat,
    Shutdown,
    TextOutput,
    TextOutputs,
    TokenOutput,
    decode,
    encode,
    make_socket,
)
from jaxserve.lifetime import die_with_parent, ignore_sigint
from jaxserve.logs import configure_logging, report_start_failure

logger = logging.getLogger("jaxserve.detokenizer")

# The test hook of the module docstring.
DELAY_ENV = "JAXSERVE_TEST_DETOKENIZER_DELAY_S"


def _name_prompt_logprobs(entries: list | None, prompt_ids: list[int] | None) -> list | None:
    """Engine prompt log-probs ([None, [logprob, top], ...], one per prompt token) ->
    [[token_id, logprob, top], ...] for prompt tokens 1.. (the first has none)."""
    if not entries or not prompt_ids:
        return None
    return [[tok, e[0], e[1]] for tok, e in zip(prompt_ids, entries, strict=False) if e is not None]


@dataclass(slots=True)
class _RequestState:
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int = 0
    stopped: bool = False  # a stop string ended it; waiting for the engine's final output
    prompt_token_ids: list[int] | None = None  # from `first`: names prompt log-prob entries


class OutputProcessor:
    """Turns engine TokenOutputs into client TextOutputs; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    @property
    def num_requests(self) -> int:
        """Requests with state here (running, or stopped and awaiting the engine's final)."""
        return len(self._requests)

    def process(self, outputs: list[TokenOutput]) -> tuple[list[TextOutput], list[str]]:
        """Returns (text outputs for the frontend, request ids the engine must abort)."""
        texts: list[TextOutput] = []
        aborts: list[str] = []
        for out in outputs:
            try:
                text = self._process_one(out, aborts)
            except Exception as e:  # the tokenizer's Rust side raises plain Exceptions too
                text = self._fail(out, e, aborts)
            if text is not None:
                texts.append(text)
        return texts, aborts

    def _fail(self, out: TokenOutput, error: Exception, aborts: list[str]) -> TextOutput | None:
        """End one request whose output could not be processed; the others go on."""
        state = self._requests.get(out.request_id)
        if state is not None and state.stopped:  # already ended; drop
            if out.finish_reason is not None:
                del self._requests[out.request_id]
            return None
        logger.warning("request %r failed in the detokenizer: %s", out.request_id, error)
        if out.finish_reason is None:
            if state is None:  # keep a state so the engine's later outputs are dropped
                state = _RequestState(IncrementalDetokenizer(self._tokenizer))
                self._requests[out.request_id] = state
            state.stopped = True
            aborts.append(out.request_id)
        else:
            self._requests.pop(out.request_id, None)
        return TextOutput(
            out.request_id,
            "",
            [],
            finish_reason="error",
            error=f"detokenizer: cannot decode the output token ids ({error})",
        )

    def _state(self, out: TokenOutput) -> _RequestState:
        state = self._requests.get(out.request_id)
        if state is None:
            # Normally `first` is set here; a request aborted or rejected before it ran
            # may finish without it, and then the defaults serve (there is no text).
            sampling = (out.first or {}).get("sampling", {})
            detok = IncrementalDetokenizer(
                self._tokenizer,
                skip_special_tokens=sampling.get("skip_special_tokens", True),
                stop=sampling.get("stop", ()),
            )
            state = _RequestState(detok)
            state.prompt_token_ids = list((out.first or {}).get("prompt_token_ids", []))
            self._requests[out.request_id] = state
        if out.num_prompt_tokens:
            state.num_prompt_tokens = out.num_prompt_tokens
        return state

    def _process_one(self, out: TokenOutput, aborts: list[str]) -> TextOutput | None:
        finished = out.finish_reason is not None
        if out.finish_reason == "error":
            self._requests.pop(out.request_id, None)
            return TextOutput(out.request_id, "", [], finish_reason="error", error=out.error)
        state = self._state(out)
        if state.stopped:  # tokens after our stop string; the engine's abort is coming
            if finished:
                del self._requests[out.request_id]
            return None
        delta = state.detokenizer.update(
            out.new_token_ids, finished=finished, stop_terminated=out.finish_reason == "stop"
        )
        text = TextOutput(
            out.request_id,
            delta.text,
            delta.token_ids,
            logprobs=out.logprobs[: len(delta.token_ids)] if out.logprobs else None,
            prompt_logprobs=_name_prompt_logprobs(out.prompt_logprobs, state.prompt_token_ids),
        )
        if delta.stop_string is not None:
            text.finish_reason, text.stop_reason = "stop", delta.stop_string
            if finished:
                del self._requests[out.request_id]
            else:
                state.stopped = True
                aborts.append(out.request_id)
        elif finished:
            text.finish_reason, text.stop_reason = out.finish_reason, out.stop_reason
            del self._requests[out.request_id]
        if text.finish_reason is not None:
            text.prompt_tokens = state.num_prompt_tokens
            text.completion_tokens = state.detokenizer.num_output_tokens
        return text


class SidecarStartError(RuntimeError):
    """The sidecar cannot start serving (its message names the cause)."""


def run_detokenizer(
    tokenizer: Tokenizer,
    detokenizer_input: str,
    frontend_input: str,
    engine_input: str,
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
    delay_s: float = 0.0,
) -> None:
    """Serve until a Shutdown message arrives (or the process is terminated).

    engine_input: where stop-string aborts go (the engine's control path). The engine's
    Heartbeats are forwarded; this process sends its own every `heartbeat_interval_s`.
    delay_s: the test hook's sleep before each batch of outputs (module docstring).

    Raises:
        SidecarStartError: a socket cannot be bound or connected (names the address).
    """
    ctx = zmq.Context()
    opened: list[zmq.Socket] = []
    try:
        for kind, address, bind in (
            (zmq.PULL, detokenizer_input, True),
            (zmq.PUSH, frontend_input, False),
            (zmq.PUSH, engine_input, False),
        ):
            opened.append(make_socket(ctx, kind, address, bind=bind))
    except zmq.ZMQError as e:
        ctx.destroy(linger=0)  # closes the failed socket too (term would wait for it)
        what = "bind" if not opened else "connect to"
        raise SidecarStartError(f"cannot {what} {address} ({e})") from e
    pull, to_frontend, to_engine = opened
    processor = OutputProcessor(tokenizer)
    last_beat = float("-inf")
    try:
        while True:
            now = time.monotonic()
            if now - last_beat >= heartbeat_interval_s:
                to_frontend.send(encode(Heartbeat("detokenizer", time.time())))
                last_beat = now
            # A frame already queued is taken at once: `poll` builds a Poller per call,
            # a cost per frame that only a wait needs.
            try:
                frame = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                if not pull.poll(max(1, int((last_beat + heartbeat_interval_s - now) * 1000))):
                    continue
                frame = pull.recv()
            try:
                msg = decode(frame)
            except Exception as e:  # one bad frame must not end every stream
                logger.warning("dropping a frame that does not decode: %s", e)
                continue
            if isinstance(msg, EngineOutputs):
                if delay_s > 0:
                    time.sleep(delay_s)
                texts, aborts = processor.process(msg.outputs)
                if aborts:  # first, so the engine stops spending steps on them
                    to_engine.send(encode(AbortRequest(aborts)))
                if texts:
                    to_frontend.send(encode(TextOutputs(texts, msg.sent_time)))
            elif isinstance(msg, EngineStats):  # with this process's CPU time on it
                msg.counters.detokenizer_cpu_s = time.process_time()
                to_frontend.send(encode(msg))
            elif isinstance(msg, Heartbeat):
                to_frontend.send(frame)
            elif isinstance(msg, Shutdown):
                return
            else:
                logger.warning("ignoring unexpected %s", type(msg).__name__)
    finally:
        for sock in (pull, to_frontend, to_engine):
            sock.close()
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="jaxserve detokenizer sidecar (started by serve)")
    parser.add_argument("--model", required=True, help="model folder with tokenizer.json")
    parser.add_argument("--detokenizer-input", required=True)
    parser.add_argument("--frontend-input", required=True)
    parser.add_argument("--engine-input", required=True, help="where stop-string aborts go")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-name", default="detokenizer", help="the [tag] of its log lines")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    ignore_sigint()
    configure_logging(args.log_level, args.log_name)
    # Start-up failures are one line (to the parent's start-error file, which `serve`
    # prints last), the traceback only at --log-level debug; exit code 2.
    try:
        tokenizer = load_tokenizer(args.model)
    except (OSError, ValueError) as e:
        report_start_failure("detokenizer", e, logger)
        sys.exit(2)
    try:
        delay_s = float(os.environ.get(DELAY_ENV) or 0.0)
    except ValueError:
        report_start_failure(
            "detokenizer",
            ValueError(f"{DELAY_ENV}: expected seconds, got {os.environ[DELAY_ENV]!r}"),
            logger,
        )
        sys.exit(2)
    if delay_s > 0:
        logger.warning("%s=%s: test hook, every output batch is delayed", DELAY_ENV, delay_s)
    try:
        run_detokenizer(
            tokenizer, args.detokenizer_input, args.frontend_input, args.engine_input,
            delay_s=delay_s,
        )  # fmt: skip
    except SidecarStartError as e:
        report_start_failure("detokenizer", e, logger)
        sys.exit(2)


if __name__ == "__main__":
    main()
