"""`LLM`: the offline, in-process API, shaped like vLLM's `LLM.generate`.

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf_folder", max_num_seqs=32)
    outs = llm.generate(["def add(", "def open("], SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].outputs[j]...

It runs an `EngineCore` in this process and detokenizes with the same
`IncrementalDetokenizer` as the server's sidecar, so stop strings and text agree with
what a gRPC or HTTP client receives. It shares the frontend's request rules where they
apply offline: text prompts are tokenized by `frontend.tokenizer.encode_prompt` and
parameters checked by `SamplingParams.validate` (llm_inputs.py), and n > 1 is fanned out
into engine requests by `frontend.validation.split_samples` (seeds seed + i, prompt
log-probs on sample 0 only). As on the servers, a prompt + max_tokens beyond
max_model_len is a ValueError (`check_lengths`; tests/test_rule_agreement.py runs each
rule on both).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from jaxserve.config import (
    DEMO_MODEL_DIR,
    CacheConfig,
    EngineConfig,
    EplbConfig,
    MeshConfig,
    SchedulerConfig,
    resolve_dtype,
)
from jaxserve.engine.core import EngineCore
from jaxserve.frontend.detokenizer import IncrementalDetokenizer
from jaxserve.frontend.validation import split_samples
from jaxserve.hub import resolve_model
from jaxserve.ipc import EngineRequest, TokenOutput
from jaxserve.llm_inputs import prepare_inputs
from jaxserve.sampling_params import SamplingParams

# vLLM spellings accepted as aliases of our config fields.
_ALIASES = {
    "gpu_memory_utilization": "memory_fraction",
    "tensor_parallel_size": "tp",
    "data_parallel_size": "dp",
}
# EPLB keyword arguments (vLLM's names) -> EplbConfig fields.
_EPLB_KWARGS = {
    "enable_eplb": "enabled",
    "num_redundant_experts": "num_redundant_experts",
    "eplb_window_size": "window_size",
    "eplb_step_interval": "step_interval",
    "eplb_min_improvement": "min_improvement",
}


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt (vLLM's CompletionOutput).

    stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    logprobs: when requested, per token [logprob, [[top_token_id, top_logprob], ...]].
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None
    logprobs: list[list] | None = None


@dataclass(slots=True)
class RequestOutput:
    """All samples of one prompt (vLLM's RequestOutput); `.text`, `.token_ids` and
    `.finish_reason` are those of the first sample.

    prompt_logprobs: when SamplingParams.prompt_logprobs is set, one entry per prompt
        token: None for the first, then [logprob, [[top_token_id, top_logprob], ...]].
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(slots=True)
class _Sample:
    """Per-engine-request bookkeeping while generate() runs."""

    prompt_index: int
    sample_index: int
    detok: IncrementalDetokenizer
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class LLM:
    """An engine and a tokenizer in this process.

    Args:
        model: HF model folder, or a Hugging Face model id (resolved through the HF
            cache, `jaxserve.hub`); None serves the bundled demo model.
        tokenizer: folder holding tokenizer.json, or the file itself (default: `model`).
        **engine_kwargs: EngineConfig fields (dtype, "auto" included, seed,
            compilation_cache_dir), its
            cache fields (block_size, num_blocks, memory_fraction, enable_prefix_caching),
            scheduler fields (max_num_seqs, max_num_batched_tokens, max_model_len,
            enable_chunked_prefill) and mesh fields (dp, tp, ep_replicated_max_tokens), or
            mesh="dp=D,tp=T" (or a MeshConfig); EPLB with vLLM's names (enable_eplb,
            num_redundant_experts, eplb_window_size, eplb_step_interval; also
            eplb_min_improvement), or eplb=EplbConfig(...); out-of-range EPLB and mesh
            values raise ValueError. vLLM's gpu_memory_utilization / tensor_parallel_size /
            data_parallel_size also work.

    Raises:
        TypeError: an unknown keyword argument (named).
        FileNotFoundError: no tokenizer.json.
    """

    def __init__(
        self, model: str | Path | None = None, tokenizer: str | Path | None = None, **engine_kwargs
    ):
        # A Hugging Face model id resolves through the HF cache, as for `jaxserve serve`.
        model_dir = Path(resolve_model(str(model))) if model is not None else DEMO_MODEL_DIR
        self.engine_config = build_engine_config(str(model_dir), **engine_kwargs)
        self.engine_config.dtype = resolve_dtype(self.engine_config.dtype, model_dir)
        self.tokenizer = _load_tokenizer(Path(tokenizer) if tokenizer else model_dir)
        self.engine = EngineCore(self.engine_config)
        self._next_id = 0

    @classmethod
    def from_engine(cls, engine: EngineCore, tokenizer: str | Path | None = None) -> LLM:
        """An LLM over an already built EngineCore (shares its compiled steps and cache)."""
        llm = cls.__new__(cls)
        llm.engine_config = engine.config
        llm.tokenizer = _load_tokenizer(Path(tokenizer or engine.config.model))
        llm.engine = engine
        llm._next_id = 0
        return llm

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: str | SequenceOf[str] | SequenceOf[SequenceOf[int]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; returns one RequestOutput per prompt, in input order.

        Args:
            prompts: a string, a list of strings, or a list of token-id lists; a prompt
                may also be a dict as vLLM's TextPrompt / TokensPrompt: {"prompt": str}
                or {"prompt_token_ids": [int, ...]} (one of the two, no other key).
            sampling_params: one for all prompts, one per prompt, or None (defaults).
                `n > 1` runs n samples of the prompt (with seeds seed, seed+1, ... when a
                seed is given); they share the prompt's full KV blocks (one engine
                request each, in one cache group: see EngineCore.add_request).

        Raises:
            ValueError: bad parameters or prompts (the message names the field), or a
                request the engine rejected (e.g. a prompt longer than max_model_len).
                Whatever it raises (KeyboardInterrupt too), the requests of this call
                are aborted first, so the LLM stays usable.
        """
        encoded, params_list = prepare_inputs(
            prompts,
            sampling_params,
            self.tokenizer,
            self.engine.model_config.vocab_size,
            self.engine.max_model_len,
        )

        samples: dict[str, _Sample] = {}
        try:
            self._add_requests(encoded, params_list, samples)
            self._run(samples)
        except BaseException:
            self._abort_all(samples)
            raise
        return _collect(encoded, params_list, samples)

    def _add_requests(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        samples: dict[str, _Sample],
    ) -> None:
        """One engine request per sample, recorded in `samples` by request id."""
        for i, ((_, ids), params) in enumerate(zip(encoded, params_list, strict=True)):
            group = f"llm-{self._next_id}" if params.n > 1 else None
            request = EngineRequest("", np.asarray(ids, np.int32), params.to_dict(), time.time())
            for j, sample in enumerate(split_samples(request)):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                detok = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop
                )
                samples[request_id] = _Sample(i, j, detok)
                self.engine.add_request(
                    dataclasses.replace(sample, request_id=request_id), cache_group=group
                )

    def _abort_all(self, samples: dict[str, _Sample]) -> None:
        """Abort this call's requests and step the engine until it is idle, so that the
        next call finds no leftover request (and no step of this one in flight)."""
        self.engine.abort_requests(sorted(samples))
        while self.engine.has_work():
            self.engine.step()

    def _run(self, samples: dict[str, _Sample]) -> None:
        pending = set(samples)
        while pending:
            for out in self.engine.step():
                sample = samples.get(out.request_id)
                if sample is None or out.request_id not in pending:
                    continue  # the final "abort" of a request a stop string already ended
                if out.finish_reason == "error":
                    raise ValueError(out.error)  # generate() aborts the others
                if self._apply(sample, out):
                    pending.discard(out.request_id)

    def _apply(self, sample: _Sample, out: TokenOutput) -> bool:
        """Detokenize one engine output; returns True when the sample is finished."""
        finished = out.finish_reason is not None
        delta = sample.detok.update(
            out.new_token_ids,
            finished=finished,
            stop_terminated=out.finish_reason == "stop",
        )
        sample.text.append(delta.text)
        sample.token_ids += delta.token_ids
        if out.logprobs:
            sample.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            sample.prompt_logprobs = out.prompt_logprobs
        if delta.stop_string is not None:
            # The engine does not know about stop strings: end the request there.
            self.engine.abort_requests([out.request_id])
            sample.finish_reason, sample.stop_reason = "stop", delta.stop_string
            return True
        if finished:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        return finished


def build_engine_config(model: str, **kwargs) -> EngineConfig:
    """EngineConfig from flat keyword arguments (see `LLM`). Raises TypeError on unknown ones."""
    sections = {"cache": CacheConfig(), "scheduler": SchedulerConfig(), "mesh": MeshConfig()}
    eplb = EplbConfig()
    top: dict = {"model": model}
    names = {f.name for f in dataclasses.fields(EngineConfig)} - set(sections) - {"eplb"}
    for key, value in kwargs.items():
        name = _ALIASES.get(key, key)
        if name == "eplb":  # an EplbConfig
            if not isinstance(value, EplbConfig):
                raise TypeError(f"eplb: expected an EplbConfig, got {value!r}")
            eplb = value
            continue
        if name in _EPLB_KWARGS:
            setattr(eplb, _EPLB_KWARGS[name], value)
            continue
        if name == "mesh":  # "dp=2,tp=4" or a MeshConfig
            if isinstance(value, str):
                # The text names dp and tp only: ep_replicated_max_tokens given beside it stays.
                parsed = MeshConfig.parse(value)
                sections["mesh"].dp, sections["mesh"].tp = parsed.dp, parsed.tp
                continue
            if not isinstance(value, MeshConfig):
                raise TypeError(f"mesh: expected 'dp=D,tp=T' or a MeshConfig, got {value!r}")
            sections["mesh"] = value
            continue
        if name in names:
            top[name] = value
            continue
        for section in sections.values():
            if name in {f.name for f in dataclasses.fields(section)}:
                setattr(section, name, value)
                break
        else:
            raise TypeError(f"LLM: unknown engine argument {key!r}")
    eplb.validate()
    sections["mesh"].validate()
    return EngineConfig(**top, **sections, eplb=eplb)


def _load_tokenizer(path: Path) -> Tokenizer:
    file = path if path.is_file() else path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer: {file} not found")
    return Tokenizer.from_file(str(file))


def _collect(
    encoded: list[tuple[str | None, list[int]]],
    params_list: list[SamplingParams],
    samples: dict[str, _Sample],
) -> list[RequestOutput]:
    by_prompt: dict[int, list[CompletionOutput]] = {i: [] for i in range(len(encoded))}
    prompt_logprobs: dict[int, list] = {}
    for sample in samples.values():
        if sample.prompt_logprobs is not None:
            prompt_logprobs.setdefault(sample.prompt_index, sample.prompt_logprobs)
        logprobs = sample.logprobs[: len(sample.token_ids)] if sample.logprobs else None
        by_prompt[sample.prompt_index].append(
            CompletionOutput(
                index=sample.sample_index,
                text="".join(sample.text),
                token_ids=sample.token_ids,
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
                cumulative_logprob=sum(e[0] for e in logprobs) if logprobs else None,
                logprobs=logprobs,
            )
        )
    return [
        RequestOutput(
            request_id=str(i),
            prompt=text,
            prompt_token_ids=ids,
            outputs=sorted(by_prompt[i], key=lambda c: c.index),
            prompt_logprobs=prompt_logprobs.get(i),
        )
        for i, (text, ids) in enumerate(encoded)
    ]
