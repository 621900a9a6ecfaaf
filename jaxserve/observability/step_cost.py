"""What one engine step costs, from its shapes: bytes read, FLOPs, and so MBU and MFU.

`StepCostModel` estimates, for one forward pass over a step's rows (each row: a chunk of
`q` new tokens of a request whose first `start` tokens are cached), the bytes the device
must read and the FLOPs it must do, from the model's `ModelConfig` only:

- weights: attention projections (q, k, v, o), dense MLPs, the gates, the LM head, read
  once per pass; an MoE layer reads only the experts its tokens route to: under uniform
  routing of T tokens with top-k of E experts, E * (1 - (1 - k/E)^T) distinct experts
  are expected (the occupancy estimate of T draws of k from E; a skewed load reads
  fewer, a lower bound of its time);
- KV cache: each layer reads the cached values of every cached or new position of each
  row and writes those of its new tokens: `2 * kv_heads * head_dim` values per token and
  layer, or with Multi-head Latent Attention (DeepSeek-V2/V3, `ModelConfig.mla`) one
  latent of `kv_lora_rank + qk_rope_head_dim`;
- FLOPs: 2 per multiply-add of every weight a token meets (k experts plus the shared
  experts per MoE layer, the LM head for one position per row), plus attention's two
  products per (query, visible key) pair: 4 * heads * head_dim, or with MLA in its
  absorbed form (scores over the latent and the RoPE key, the output over the latent;
  DeepSeek-V2 paper, section 2.1.2) 2 * heads * (2 * kv_lora_rank + qk_rope_head_dim).
  Causal: a chunk of q tokens after `start` cached ones sees q * start + q (q + 1) / 2
  pairs. Sliding windows are not capped (an upper bound).

`StepMeter` applies it to the engine's steps: `dispatched` when a step leaves for the
device, `fetched` when its results are on the host; the time between is the step's time
(an upper bound of its device time), and MBU = bytes / time / peak bandwidth, MFU =
FLOPs / time / peak FLOP/s (`observability.peaks`). It also counts the prefill and decode
tokens of each step (the steps with each, the last step's). Python arithmetic per row,
no arrays; no JAX here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxserve.observability.peaks import Peak

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step's estimate: bytes read or written (weights + KV) and FLOPs."""

    weight_bytes: float
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


class StepCostModel:
    """Bytes and FLOPs of forward passes of one model (see the module docstring).

    Args:
        cfg: the model's `models.config.ModelConfig`.
        dtype: weight dtype name ("float32", "bfloat16", "float16").
        kv_dtype: KV cache dtype name (default: `dtype`).

    Attributes (elements unless named *_bytes):
        attn_params / dense_mlp_params / expert_params / gate_params /
            shared_expert_params: per layer (one routed expert for expert_params; all
            shared experts of a DeepSeek MoE layer for shared_expert_params).
        kv_values_per_token: cached values of one token in one layer.
        attn_flops_per_pair: attention FLOPs of one (query, visible key) pair, all
            heads of one layer.
        lm_head_params: vocab_size * hidden_size.
        total_weight_bytes: every weight of the model (all experts, embeddings).
        kv_bytes_per_token: KV cache bytes of one token over all layers.
    """

    def __init__(self, cfg, dtype: str = "float32", kv_dtype: str | None = None) -> None:
        d = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.heads = cfg.num_attention_heads
        self.itemsize = _ITEMSIZE[dtype]
        self.kv_itemsize = _ITEMSIZE[kv_dtype or dtype]
        self.attn_params, attn_norms, self.kv_values_per_token, self.attn_flops_per_pair = (
            _attention(cfg) if cfg.mla is None else _mla_attention(cfg)
        )
        self.dense_mlp_params = 3 * d * cfg.intermediate_size
        self.expert_params = 3 * d * cfg.moe_intermediate_size
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        gate = cfg.grouped_gate
        # DeepSeek: the shared experts (always on) and V3's e_score_correction_bias.
        self.shared_expert_params = gate.n_shared_experts * self.expert_params if gate else 0
        gate_bias = cfg.num_experts if gate is not None and gate.correction_bias else 0
        self.gate_params = d * cfg.num_experts + gate_bias
        self.moe_layers = sum(cfg.is_moe_layer(i) for i in range(self.num_layers))
        self.dense_layers = self.num_layers - self.moe_layers
        self.lm_head_params = cfg.vocab_size * d
        self.embed_params = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
        self.hidden = d
        norms = d * (2 * self.num_layers + 1) + attn_norms * self.num_layers
        self.total_weight_bytes = self.itemsize * (
            self.num_layers * self.attn_params
            + self.dense_layers * self.dense_mlp_params
            + self.moe_layers
            * (self.gate_params + self.shared_expert_params + self.num_experts * self.expert_params)
            + self.lm_head_params
            + self.embed_params
            + norms
        )
        self.kv_bytes_per_token = self.kv_values_per_token * self.kv_itemsize * self.num_layers

    def expected_experts(self, num_tokens: int) -> float:
        """Distinct experts one MoE layer is expected to read for `num_tokens` tokens
        under uniform top-k routing: E * (1 - (1 - k / E) ** T)."""
        e, k = self.num_experts, self.top_k
        if e == 0 or num_tokens == 0:
            return 0.0
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    def cost(self, rows: list[tuple[int, int]]) -> StepCost:
        """One forward pass over `rows`, each (start, q): q new tokens after `start`
        cached ones (a decode row is (context - 1, 1)). Every row emits one position
        of logits."""
        t = sum(q for _, q in rows)
        if t == 0:
            return StepCost(0.0, 0.0, 0.0)
        positions = sum(s + q for s, q in rows)  # KV positions read per layer
        pairs = sum(q * s + q * (q + 1) / 2 for s, q in rows)  # causal (query, key) pairs
        experts = self.expected_experts(t)
        moe_always = self.gate_params + self.shared_expert_params
        weights = (
            self.num_layers * self.attn_params
            + self.dense_layers * self.dense_mlp_params
            + self.moe_layers * (moe_always + experts * self.expert_params)
            + self.lm_head_params
        )
        kv = self.kv_bytes_per_token * (positions + t)  # read every position, write the new
        macs = (
            t
            * (
                self.num_layers * self.attn_params
                + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * (moe_always + self.top_k * self.expert_params)
            )
            + len(rows) * self.lm_head_params
        )
        attention = self.attn_flops_per_pair * pairs * self.num_layers
        return StepCost(weights * self.itemsize + t * self.hidden * self.itemsize, kv,
                        2 * macs + attention)  # fmt: skip


def _attention(cfg) -> tuple[int, int, int, int]:
    """Grouped-query attention: (projection params, norm params, cached values per token,
    FLOPs per (query, key) pair), one layer. q/k norms are counted (Qwen3's; Llama and
    Mixtral have none, 2 * head_dim elements per layer too many there)."""
    d, hd, h, kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    params = 2 * d * h * hd + 2 * d * kv * hd
    if cfg.attention_qkv_bias:
        params += h * hd + 2 * kv * hd
    return params, 2 * hd, 2 * kv * hd, 4 * h * hd


def _mla_attention(cfg) -> tuple[int, int, int, int]:
    """Multi-head Latent Attention (`models/mla.py`), the same four numbers: q (through
    its LoRA when q_lora_rank is set), kv_a (latent + RoPE key), kv_b (latent -> per-head
    no-RoPE key and value) and o projections; the q_a / kv_a norms; one latent cached per
    token; the absorbed attention's FLOPs per pair."""
    m, d, h = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    q_out = h * m.qk_head_dim
    q = d * q_out if m.q_lora_rank is None else d * m.q_lora_rank + m.q_lora_rank * q_out
    params = (
        q
        + d * m.latent_dim
        + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
        + h * m.v_head_dim * d
    )
    norms = m.kv_lora_rank + (m.q_lora_rank or 0)
    return params, norms, m.latent_dim, 2 * h * (2 * m.kv_lora_rank + m.qk_rope_head_dim)


def step_rows(sched) -> tuple[list[tuple[int, int]], int, int, int]:
    """A step's rows for `StepCostModel.cost`, over every dp rank, and its token counts.

    sched: a `SchedulerOutput` (rows in `requests` with seq / start / num_tokens /
    samples, all ranks, and `num_steps`).

    Returns (rows, num_passes, prefill_tokens, decode_tokens); a multi-step decode call
    is num_passes > 1 passes over its decode rows (rows as of the first pass).
    """
    rows: list[tuple[int, int]] = []
    prefill = decode = 0
    num_steps = sched.num_steps
    for r in sched.requests:
        rows.append((r.start, r.num_tokens))
        if num_steps > 1 or (
            r.samples and r.num_tokens == 1 and r.start >= r.seq.num_prompt_tokens
        ):
            decode += r.num_tokens * num_steps
        else:
            prefill += r.num_tokens
    return rows, num_steps, prefill, decode


def multi_pass_cost(model: StepCostModel, rows: list[tuple[int, int]], passes: int) -> StepCost:
    """The cost of a call of `passes` passes: `rows` (as `StepCostModel.cost`), then
    passes - 1 decode passes of one token a row, pass p at start s + q + p - 1.

    A decode pass's cost is affine in p (the same weights; KV bytes and attention pairs
    grow by one position a row), so passes 1..P-1 sum to (P - 1) c1 + (c2 - c1)(P - 1)(P -
    2) / 2 from the first two: two `cost` calls, not P (on the host, every call)."""
    c = model.cost(rows)
    if passes <= 1:
        return c
    first = model.cost([(s + q, 1) for s, q in rows])
    second = model.cost([(s + q + 1, 1) for s, q in rows]) if passes > 2 else first
    n, ramp = passes - 1, (passes - 1) * (passes - 2) / 2

    def total(a: float, b: float, c0: float) -> float:
        return c0 + n * a + ramp * (b - a)

    return StepCost(
        total(first.weight_bytes, second.weight_bytes, c.weight_bytes),
        total(first.kv_bytes, second.kv_bytes, c.kv_bytes),
        total(first.flops, second.flops, c.flops),
    )


class StepMeter:
    """Per-step cost, time and utilisation of an engine (see the module docstring).

    Args:
        model: the `StepCostModel` of the served model.
        peak: the peak of the mesh (`peaks.mesh_peak`), or None (MBU/MFU stay 0).
        dtype: the compute dtype (chooses the peak FLOP/s).
        clock: seconds, monotonic (default time.perf_counter).
    """

    def __init__(self, model: StepCostModel, peak: Peak | None, dtype: str = "float32",
                 clock=time.perf_counter) -> None:  # fmt: skip
        self.model = model
        self.peak_bytes_per_s = peak.bytes_per_s if peak else 0.0
        self.peak_flops_per_s = peak.flops(dtype) if peak else 0.0
        # A measured ceiling (the CPU's, at start-up beside compiles and other processes)
        # can come out below what a step then achieves (diagnose showed MFU 1.08): a step's
        # rate is a lower bound of the peak too (its time runs from dispatch to fetch, so
        # it includes host work), so a faster step raises it. A data-sheet peak stays.
        self._raise_peak = peak is not None and peak.measured
        self._clock = clock
        self._inflight: dict[int, tuple[float, StepCost]] = {}
        self.step_time_s = 0.0
        self.model_bytes = 0.0
        self.model_flops = 0.0
        self.last_mbu = 0.0
        self.last_mfu = 0.0
        self.prefill_steps = 0
        self.decode_steps = 0
        self.last_prefill_tokens = 0
        self.last_decode_tokens = 0

    def dispatched(self, handle: object, sched) -> None:
        """A step left for the device (`handle`: what `fetched` will be given)."""
        rows, passes, prefill, decode = step_rows(sched)
        self.prefill_steps += prefill > 0
        self.decode_steps += decode > 0
        self.last_prefill_tokens, self.last_decode_tokens = prefill, decode
        self._inflight[id(handle)] = (self._clock(), multi_pass_cost(self.model, rows, passes))

    def fetched(self, handle: object) -> None:
        """A step's results are on the host: its time, bytes, FLOPs, MBU and MFU."""
        start, c = self._inflight.pop(id(handle), (None, None))
        if start is None:
            return
        dt = max(self._clock() - start, 1e-9)
        self.step_time_s += dt
        self.model_bytes += c.bytes
        self.model_flops += c.flops
        if self._raise_peak:
            self.peak_bytes_per_s = max(self.peak_bytes_per_s, c.bytes / dt)
            self.peak_flops_per_s = max(self.peak_flops_per_s, c.flops / dt)
        if self.peak_bytes_per_s:
            self.last_mbu = c.bytes / dt / self.peak_bytes_per_s
            self.last_mfu = c.flops / dt / self.peak_flops_per_s
