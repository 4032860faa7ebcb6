"""A GPT-style decoder (nanoGPT-like), the main example model of the planner.

    from examples.gpt import gpt_tiny
    model, inputs = gpt_tiny()
    logits = model(*inputs)                      # (B, T, vocab_size)
    loss = model.loss_fn(logits, inputs)         # next-token cross-entropy

Module tree (names are what a plan refers to)::

    GPT
      tok_emb, pos_emb, drop
      blocks.<i>: Block
        ln_1
        attn: CausalSelfAttention
          qkv, core: AttentionCore (scores, mask, softmax, dropout, @v), proj, resid_drop
        ln_2
        mlp: MLP (fc, act, proj, drop)
      ln_f, lm_head

``attn.core`` is its own module so that a Megatron-style policy ("recompute only the attention
core", Korthikanti et al. 2022) can target it by name. Both attention implementations build the same
module tree, so a plan made for one applies to the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "AttentionCore",
    "MLP",
    "gpt_loss",
    "build_gpt",
    "gpt_tiny",
    "gpt_small",
    "gpt_bench",
]

AttnImpl = Literal["sdpa", "math"]
_ATTN_IMPLS = ("sdpa", "math")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and options of a GPT decoder."""

    vocab_size: int
    """Number of token ids; the output has one logit per id."""
    seq_len: int
    """Maximum sequence length (size of the position embedding and of the causal mask)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``dim``."""
    dim: int
    """Model (residual stream) width."""
    mlp_ratio: int = 4
    """MLP hidden width is ``mlp_ratio * dim``."""
    dropout: float = 0.1
    """Dropout probability after embeddings, on attention probabilities and on residual branches."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""
    attn_impl: AttnImpl = "sdpa"
    """``"sdpa"``: ``F.scaled_dot_product_attention`` (fused kernel, nothing of size T x T saved).
    ``"math"``: explicit scores/mask/softmax/dropout/@v (Megatron's core attention), which
    materialises the T x T score and probability matrices."""
    tie_weights: bool = False
    """Share the token-embedding matrix with the output projection."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "dim", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_head:
            raise ValueError(f"GPTConfig.dim ({self.dim}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.attn_impl not in _ATTN_IMPLS:
            raise ValueError(f"GPTConfig.attn_impl must be one of {_ATTN_IMPLS}, got {self.attn_impl!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v, with dropout on the probabilities.

    Takes q, k, v of shape (B, H, T, head_dim) and returns (B, H, T, head_dim). Holds no
    parameters: what it keeps for backward (the T x T matrices in ``"math"`` mode) is exactly what
    Megatron's selective recompute discards.
    """

    def __init__(self, *, seq_len: int, dropout: float, impl: AttnImpl) -> None:
        super().__init__()
        if impl not in _ATTN_IMPLS:
            raise ValueError(f"attention impl must be one of {_ATTN_IMPLS}, got {impl!r}")
        self.impl = impl
        # A module (not F.dropout) so both impls share one module tree; "sdpa" reads only its p.
        self.attn_drop = nn.Dropout(dropout)
        if impl == "math":
            # True where a query may attend (key position <= query position). A buffer, created
            # here, so it follows .to()/meta/fake conversion and forward has no data-dependent code.
            mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.impl == "sdpa":
            dropout_p = self.attn_drop.p if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        T, S = q.size(-2), k.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, S)
        scores = scores.masked_fill(~self.causal_mask[:T, :S], float("-inf"))
        probs = self.attn_drop(F.softmax(scores, dim=-1))  # (B, H, T, S)
        return probs @ v  # (B, H, T, head_dim)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: fused qkv projection, attention core, output projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=config.bias)
        self.core = AttentionCore(seq_len=config.seq_len, dropout=config.dropout, impl=config.attn_impl)
        self.proj = nn.Linear(config.dim, config.dim, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        H = self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, hd)
        v = v.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, hd)
        y = self.core(q, k, v)  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """dim -> mlp_ratio * dim -> GELU -> dim, with dropout on the output."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.dim
        self.fc = nn.Linear(config.dim, hidden, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, config.dim, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.dim, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.dim, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layer`` blocks, final LayerNorm, LM head.

    ``forward(idx)`` maps token ids (B, T) to logits (B, T, vocab_size); the loss is separate
    (:meth:`loss_fn`) so the planner can pick its own.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.example_batch_size = 2
        """Batch size of :meth:`example_inputs` when none is given."""
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.pos_emb = nn.Embedding(config.seq_len, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.dim, bias=config.bias)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation; residual projections scaled by 1/sqrt(2 * n_layer).

        A no-op on the meta device; call it after ``to_empty()`` to get real weights.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # Each block adds two residual branches; scaling keeps the stream's variance bounded.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(f"sequence length {T} exceeds GPTConfig.seq_len={self.config.seq_len}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, dim)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)

    def example_inputs(
        self, batch_size: int | None = None, *, device: torch.device | str | None = None
    ) -> tuple[Tensor]:
        """``(idx,)``: random token ids (batch_size, seq_len) on the model's device.

        ``batch_size=None`` uses ``self.example_batch_size`` (set by the factory that built the
        model). Deterministic given ``torch.manual_seed``; works on the meta device.
        """
        batch_size = self.example_batch_size if batch_size is None else batch_size
        device = self.tok_emb.weight.device if device is None else device
        idx = torch.randint(0, self.config.vocab_size, (batch_size, self.config.seq_len), device=device)
        return (idx,)

    def loss_fn(self, output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
        """Next-token cross-entropy; same contract as :func:`gpt_loss`."""
        return gpt_loss(output, inputs)


def gpt_loss(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross-entropy: logits at position t predict token t + 1 of ``inputs[0]``.

    ``output`` is the logits (B, T, V) of ``model(*inputs)``; returns a scalar.
    """
    (idx,) = inputs
    logits = output[:, :-1, :]  # (B, T-1, V): the last position has no next token
    targets = idx[:, 1:]  # (B, T-1)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_gpt(
    config: GPTConfig,
    batch_size: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> tuple[GPT, tuple[Tensor]]:
    """Build a GPT and its example inputs, deterministically, without touching the global RNG.

    ``device="meta"`` builds without allocating (parameters have shapes, no data).
    """
    # fork_rng(devices=[]) restores the CPU RNG afterwards and never touches CUDA.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device or "cpu"):
            model = GPT(config)
        if dtype is not None:
            model = model.to(dtype=dtype)
        model.example_batch_size = batch_size
        inputs = model.example_inputs()
    return model, inputs


def gpt_tiny(
    *, device: torch.device | str | None = None, attn_impl: AttnImpl = "sdpa"
) -> tuple[GPT, tuple[Tensor]]:
    """2 layers, dim 64, 4 heads, vocab 256, seq 32, batch 2: a full step takes milliseconds on CPU."""
    config = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, dim=64, attn_impl=attn_impl)
    return build_gpt(config, batch_size=2, device=device)


def gpt_small(
    *, device: torch.device | str | None = None, attn_impl: AttnImpl = "sdpa"
) -> tuple[GPT, tuple[Tensor]]:
    """4 layers, dim 128, 4 heads, vocab 512, seq 64, batch 4: still CPU-fast, deeper tree."""
    config = GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_head=4, dim=128, attn_impl=attn_impl)
    return build_gpt(config, batch_size=4, device=device)


def gpt_demo(
    *, device: torch.device | str | None = None, attn_impl: AttnImpl = "sdpa"
) -> tuple[GPT, tuple[Tensor]]:
    """4 layers, dim 128, 4 heads, vocab 512, seq 256, batch 8: activations dominate the step's
    memory (as in real training), yet a step runs in well under a second on CPU. The CLI default."""
    config = GPTConfig(vocab_size=512, seq_len=256, n_layer=4, n_head=4, dim=128, attn_impl=attn_impl)
    return build_gpt(config, batch_size=8, device=device)


def gpt_bench(
    *,
    device: torch.device | str | None = None,
    n_layer: int = 4,
    attn_impl: AttnImpl = "sdpa",
) -> tuple[GPT, tuple[Tensor]]:
    """The benchmark decoder: dim 768, 12 heads, vocab 8192, seq 1024, batch 8 (4 layers by default).

    The same shape torch.distributed._tools' SAC ILP test uses. Pass ``device="meta"`` to build
    it without allocating.
    """
    config = GPTConfig(
        vocab_size=8192, seq_len=1024, n_layer=n_layer, n_head=12, dim=768, attn_impl=attn_impl
    )
    return build_gpt(config, batch_size=8, device=device)
