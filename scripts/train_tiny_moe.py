"""Train the tiny Qwen3-MoE demo model that ships in `jaxserve/demo_model/`.

What it does, deterministically (same machine + same command -> same bytes):

1. Corpus: the top-level `*.py` files of this Python's standard library
   (`sysconfig.get_paths()["stdlib"]`), sorted by name: text every machine has offline.
   Every `--val-every`-th file is held out for validation, so the validation loss is
   measured on unseen modules rather than unseen windows of seen ones.
2. Tokenizer: byte-level BPE trained with `tokenizers`. A code-aware split runs before the
   byte-level mapping: identifiers, digit groups and punctuation runs, each with at most
   one trailing space, and whitespace runs are separate pre-tokens. Unlike GPT-2's split,
   which glues a space onto the *next* word, the space stays with the word before it, so
   a prompt that ends in a space ("import ") tokenizes exactly as in training ("import ")
   and the next token is a bare name ("os"): a pattern even a tiny model learns.
3. Data: every file is tokenized once, files are joined with `<|endoftext|>`, and the
   stream is cut into windows of `seq_len` tokens that start at line starts, each led by
   `<|endoftext|>` as BOS (the tokenizer prepends it to prompts too), so that the start
   of a window looks like the start of a prompt. Inputs are a window minus its last
   token, targets the window shifted by one.
4. Model: `jaxserve.models.qwen3_moe.Qwen3MoeForCausalLM` in its cache-less mode,
   vmapped over the batch, initialised like HF (`normal(0, initializer_range)` for
   matrices, ones for RMSNorm weights) from `--seed`.
5. Optimiser: optax AdamW with linear warm-up then cosine decay, global-norm clipping.
   Loss: next-token cross-entropy only. No gate load-balancing loss (Switch
   Transformer, Fedus et al. 2021): the model's cache-less forward returns hidden states
   and does not expose gate logits, and the demo does not need balanced experts.
6. Output: a Hugging Face folder (config.json, model.safetensors, tokenizer.json,
   tokenizer_config.json, generation_config.json) that both `jaxserve` and
   `transformers.AutoModelForCausalLM` load.

Usage (with the defaults, 10-16 minutes on 2 CPU cores shared with other jobs):
    JAX_PLATFORMS=cpu .venv/bin/python scripts/train_tiny_moe.py [--out DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import save_hf_weights
from jaxserve.models.qwen3_moe import Qwen3MoeForCausalLM

EOS_TOKEN = "<|endoftext|>"

# Code-aware pre-split (see module docstring): identifiers, 1-3 digit groups and
# punctuation runs, each keeping one trailing space; then whitespace runs, so that
# newline + indentation is one pre-token and BPE learns whole indents.
_PRE_SPLIT = r"[_\p{L}][_\p{L}\p{N}]* ?|\p{N}{1,3} ?|[^\s\p{L}\p{N}_]+ ?|\s+"


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Every knob of one training run; the defaults produce the committed demo model."""

    seed: int = 0
    # Data.
    vocab_size: int = 4096
    seq_len: int = 128
    val_every: int = 32  # every val_every-th stdlib file (sorted) is held out
    val_windows: int = 64  # validation windows evaluated (fixed, the first ones)
    # Optimisation.
    # Sized from measurements: the MoE block computes every expert densely on the CPU,
    # and a step of 16 x 128 tokens took 0.8-1.3 s on 2 CPU cores shared with other jobs;
    # 700 steps see ~1.4M tokens, about 1.1 epochs.
    steps: int = 700
    batch_size: int = 16
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 0.01  # only written to config.json (see docstring)
    eval_interval: int = 100
    log_interval: int = 10
    # Model (Qwen3-MoE architecture).
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 1024
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False


# --------------------------------------------------------------------------- corpus


def stdlib_source_files(stdlib_dir: Path | None = None) -> list[Path]:
    """The top-level `*.py` files of the standard library, sorted by file name.

    Args:
        stdlib_dir: defaults to `sysconfig.get_paths()["stdlib"]` of this interpreter.
    Raises:
        FileNotFoundError: the directory holds no `.py` files.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(f"stdlib_dir: no *.py files under {root}")
    return files


def read_texts(files: list[Path]) -> list[str]:
    """File contents as text; undecodable bytes become U+FFFD (no file is dropped)."""
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def split_train_val(texts: list[str], val_every: int) -> tuple[list[str], list[str]]:
    """Hold out every `val_every`-th text (indices val_every-1, 2*val_every-1, ...)."""
    if val_every < 2:
        raise ValueError(f"val_every: must be >= 2, got {val_every}")
    val = [t for i, t in enumerate(texts) if i % val_every == val_every - 1]
    train = [t for i, t in enumerate(texts) if i % val_every != val_every - 1]
    return train, val


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over `texts`, with `<|endoftext|>` as id 0 (EOS, BOS and padding).

    The `tokenizers` BPE trainer is deterministic for a fixed input order (ties between
    equally frequent pairs break by the pair itself), so no seed is needed.

    Returns:
        A `tokenizers.Tokenizer` with a code-aware split + ByteLevel pre-tokenizer, a
        ByteLevel decoder, and a post-processor that prepends `<|endoftext|>` as BOS (as
        Llama's tokenizer prepends `<s>`): `encode(s).ids == [0] + encode(s,
        add_special_tokens=False).ids` and `decode(encode(s).ids) == s` for any `s`.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRE_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    # Every training window starts with BOS (see pack_windows), so every prompt must too.
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOS_TOKEN} $A",
        pair=f"{EOS_TOKEN} $A {EOS_TOKEN} $B:1",
        special_tokens=[(EOS_TOKEN, eos_id)],
    )
    return tokenizer


def pack_windows(tokenizer: Tokenizer, texts: list[str], eos_id: int, seq_len: int) -> np.ndarray:
    """Tokenize `texts`, join them with `eos_id` after each, cut into BOS-led windows.

    Window k is `eos_id` (as BOS) followed by `seq_len` tokens of the stream from the first
    *line start* at or after token k * seq_len (a line start follows a newline or
    `eos_id`). Both choices make the start of a window look like the start of a prompt
    ("import ", "def "), which the tokenizer also prefixes with BOS: with windows cut at
    arbitrary tokens and no BOS, position 0 only ever saw mid-line tokens with nothing to
    attend to, and greedy completions of a bare "import " were visibly worse than of
    "\nimport ". Windows therefore overlap by a few tokens or leave short gaps.

    Returns:
        int32 array [num_windows, seq_len + 1] (inputs = [:, :-1], targets = [:, 1:]).
    Raises:
        ValueError: the corpus is shorter than one window.
    """
    stream = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        stream.extend(encoding.ids)
        stream.append(eos_id)
    tokens = np.asarray(stream, dtype=np.int32)
    if len(tokens) <= seq_len:
        raise ValueError(f"seq_len: corpus of {len(tokens)} tokens is shorter than {seq_len}")
    ends_line = np.array(
        [i == eos_id or "\n" in tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())]
    )
    line_starts = np.flatnonzero(ends_line[tokens[:-1]]) + 1
    line_starts = line_starts[line_starts + seq_len <= len(tokens)]
    targets = np.arange(0, len(tokens) - seq_len, seq_len)
    picked = np.searchsorted(line_starts, targets)
    starts = np.unique(line_starts[picked[picked < len(line_starts)]])
    body = tokens[starts[:, None] + np.arange(seq_len)[None, :]]
    return np.concatenate([np.full((len(body), 1), eos_id, np.int32), body], axis=1)


def batch_schedule(num_windows: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """Window indices for every step: epochs of seeded permutations, concatenated.

    Returns:
        int64 array [steps, batch_size].
    """
    rng = np.random.default_rng(seed)
    needed = steps * batch_size
    order = np.concatenate(
        [rng.permutation(num_windows) for _ in range(math.ceil(needed / num_windows))]
    )
    return order[:needed].reshape(steps, batch_size)


# --------------------------------------------------------------------------- HF files


def hf_config(cfg: TrainConfig, eos_id: int) -> dict:
    """The `config.json` of a Qwen3-MoE model with `cfg`'s sizes (all layers sparse)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        # Width of a dense MLP layer; unused here (every layer is MoE) but required.
        "intermediate_size": 2 * cfg.moe_intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        # Both spellings: transformers 5.x reads rope_parameters, 4.x reads rope_theta.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "dtype": "float32",
    }


def tokenizer_config(cfg: TrainConfig) -> dict:
    """`tokenizer_config.json` that `transformers.AutoTokenizer` accepts."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
    }


def generation_config(eos_id: int) -> dict:
    """`generation_config.json`: greedy by default, stop at `<|endoftext|>`."""
    return {
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "do_sample": False,
    }


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- main


def parse_args() -> tuple[TrainConfig, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR, help="output folder")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    args = vars(parser.parse_args())
    out = args.pop("out")
    return TrainConfig(**args), out


# --------------------------------------------------------------------------- model + training


def build_model(hf: dict, seed: int, initializer_range: float):
    """A float32 `Qwen3MoeForCausalLM` for config dict `hf`, initialised like HF.

    The init is done here rather than left to the model's constructor so that the demo
    weights depend only on this script: matrices ~ normal(0, initializer_range), 1-D
    weights (RMSNorm scales) = 1, one PRNG key per weight folded from `seed`.
    """
    model = Qwen3MoeForCausalLM(ModelConfig.from_hf(hf), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    key = jax.random.key(seed)
    new = [
        jnp.ones_like(x)
        if x.ndim == 1
        else initializer_range * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
        for i, x in enumerate(leaves)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model


def make_optimizer(cfg: TrainConfig):
    """AdamW (Loshchilov & Hutter 2019) with linear warm-up + cosine decay to
    `min_lr_ratio * peak_lr`, global-norm clipping; no weight decay on 1-D weights."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.peak_lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps,
        end_value=cfg.peak_lr * cfg.min_lr_ratio,
    )
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731
    optimizer = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask),
    )
    return optimizer, schedule


def make_step_fns(model, optimizer):
    """Jitted (train_step, eval_loss) over the model's split state.

    train_step(params, opt_state, windows[B, L+1]) -> (params, opt_state, loss);
    eval_loss(params, windows[B, L+1]) -> mean next-token cross-entropy (nats/token).
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, windows):
        model = nnx.merge(graphdef, params, rest)
        inputs, targets = windows[:, :-1], windows[:, 1:]
        positions = jnp.arange(inputs.shape[1], dtype=jnp.int32)
        # Cache-less mode: each row is one causal sequence; vmap gives the batch axis.
        hidden = jax.vmap(lambda tokens: model(tokens, positions, None, None)[0])(inputs)
        logits = model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets.reshape(-1))
        return jnp.mean(losses)

    @jax.jit
    def train_step(params, opt_state, windows):
        loss, grads = jax.value_and_grad(loss_fn)(params, windows)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return params, jax.jit(loss_fn), train_step


def evaluate(eval_loss, params, windows: np.ndarray, batch_size: int) -> float:
    """Mean loss over `windows` in batches of `batch_size` (the tail batch is dropped)."""
    losses = [
        float(eval_loss(params, windows[i : i + batch_size]))
        for i in range(0, len(windows) - batch_size + 1, batch_size)
    ]
    return float(np.mean(losses))


def train(cfg: TrainConfig, out: Path) -> None:
    """Run the whole pipeline and write the HF folder to `out`."""
    start = time.perf_counter()
    files = stdlib_source_files()
    train_texts, val_texts = split_train_val(read_texts(files), cfg.val_every)
    tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    train_windows = pack_windows(tokenizer, train_texts, eos_id, cfg.seq_len)
    val_windows = pack_windows(tokenizer, val_texts, eos_id, cfg.seq_len)[: cfg.val_windows]
    print(
        f"corpus: {len(files)} files ({len(val_texts)} held out), "
        f"{train_windows.size:,} train tokens in {len(train_windows)} windows, "
        f"{len(val_windows)} val windows of {cfg.seq_len}; "
        f"{cfg.steps * cfg.batch_size / len(train_windows):.2f} epochs",
        flush=True,
    )

    config = hf_config(cfg, eos_id)
    model = build_model(config, cfg.seed, cfg.initializer_range)
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {num_params:,} parameters", flush=True)
    optimizer, schedule = make_optimizer(cfg)
    params, eval_loss, train_step = make_step_fns(model, optimizer)
    opt_state = optimizer.init(params)
    schedule_idx = batch_schedule(len(train_windows), cfg.batch_size, cfg.steps, cfg.seed)

    train_start = time.perf_counter()
    running = []
    for step in range(cfg.steps):
        params, opt_state, loss = train_step(params, opt_state, train_windows[schedule_idx[step]])
        running.append(loss)
        if (step + 1) % cfg.log_interval == 0 or step + 1 == cfg.steps:
            elapsed = time.perf_counter() - train_start
            tokens = (step + 1) * cfg.batch_size * cfg.seq_len
            print(
                f"step {step + 1:5d}  loss {np.mean(jax.device_get(running)):.4f}  "
                f"lr {float(schedule(step)):.2e}  {tokens / elapsed:,.0f} tok/s  "
                f"{elapsed:6.0f} s",
                flush=True,
            )
            running = []
        if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps:
            val = evaluate(eval_loss, params, val_windows, cfg.batch_size)
            print(f"step {step + 1:5d}  val_loss {val:.4f}", flush=True)

    nnx.update(model, params)
    out.mkdir(parents=True, exist_ok=True)
    save_hf_weights(model, out)
    write_json(out / "config.json", config)
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(cfg))
    write_json(out / "generation_config.json", generation_config(eos_id))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"wrote {out} ({size / 2**20:.1f} MiB); training {time.perf_counter() - train_start:.0f} s,"
        f" total {time.perf_counter() - start:.0f} s",
        flush=True,
    )


def main() -> None:
    cfg, out = parse_args()
    train(cfg, out)


if __name__ == "__main__":
    main()
