"""A Llama-3-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, no biases.

    from examples.llama import llama_tiny, llama3_70b
    model, inputs = llama_tiny()                 # real CPU tensors, a step in milliseconds
    model, inputs = llama3_70b()                 # 80 layers, 70.6B parameters, on the meta device

Module names follow Meta's reference implementation and torchtitan (``layers.<i>.attention.wq``,
``layers.<i>.feed_forward.w1``...), so plans read like the configs people already know.

Meta / fake friendliness: the rotary tables are real-valued cos/sin buffers created in ``__init__``
(no complex dtypes, whose meta/fake support is spotty), and ``forward`` has no ``.item()`` or
data-dependent control flow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.gpt import AttentionCore

__all__ = [
    "LlamaConfig",
    "Llama",
    "TransformerBlock",
    "Attention",
    "FeedForward",
    "RMSNorm",
    "apply_rotary",
    "llama_loss",
    "build_llama",
    "llama_tiny",
    "llama3_8b",
    "llama3_70b",
    "llama3_405b",
]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and options of a Llama decoder."""

    vocab_size: int
    """Number of token ids."""
    seq_len: int
    """Maximum sequence length (size of the rotary tables)."""
    n_layers: int
    """Number of transformer blocks."""
    dim: int
    """Model (residual stream) width."""
    n_heads: int
    """Query heads; must divide ``dim``."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_dim: int
    """Hidden width of the SwiGLU feed-forward."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500_000.0
    """Rotary base frequency (Llama 3 uses 500k)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_parameters(self) -> int:
        """Parameter count, computed from the shapes alone (untied embedding and output)."""
        hd = self.head_dim
        attention = self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2  # wq, wo; wk, wv
        feed_forward = 3 * self.dim * self.ffn_dim  # w1, w2, w3
        norms = 2 * self.dim
        embeddings = 2 * self.vocab_size * self.dim  # tok_embeddings + output
        return self.n_layers * (attention + feed_forward + norms) + self.dim + embeddings


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as in the reference implementation."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation angles, each (seq_len, head_dim // 2), float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (hd/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x (B, T, H, hd) by the angles of position t.

    The real-valued form of the reference's complex multiply ``x * exp(i * angle)``.
    """
    B, T, H, hd = x.shape
    pairs = x.float().unflatten(-1, (hd // 2, 2))  # (B, T, H, hd/2, 2)
    x0, x1 = pairs.unbind(-1)  # 2 x (B, T, H, hd/2)
    cos = cos[:T].view(1, T, 1, hd // 2)
    sin = sin[:T].view(1, T, 1, hd // 2)
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, T, H, hd/2, 2)
    return rotated.flatten(-2).type_as(x)  # (B, T, H, hd)


class Attention(nn.Module):
    """Grouped-query attention with rotary position embeddings; the core is ``attention.core``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.core = AttentionCore(seq_len=config.seq_len, dropout=0.0, impl="sdpa")
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism a rank's projections hold H / tp and KV / tp heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, KV, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, KV, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Each KV head serves n_heads // n_kv_heads query heads. repeat_interleave (rather than SDPA's
        # enable_gqa) works on every backend, meta and fake included.
        n_rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(n_rep, dim=2)  # (B, T, H, hd)
        v = v.repeat_interleave(n_rep, dim=2)  # (B, T, H, hd)
        y = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * hd)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token embedding, ``n_layers`` blocks, final RMSNorm, untied output projection.

    ``forward(tokens)`` maps token ids (B, T) to logits (B, T, vocab_size) in the model's dtype.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.example_batch_size = 1
        """Batch size of :meth:`example_inputs` when none is given."""
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # One shared table for all layers (not one per layer): 2 x T x hd/2 floats in all.
        cos, sin = rotary_tables(config.head_dim, config.seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Small-normal weights, unit norms, fresh rotary tables (float32).

        A no-op for data on the meta device; call it after ``to_empty()`` to get real values.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.reset_rope()

    def reset_rope(self) -> None:
        """Recompute the float32 rotary tables on the parameters' device.

        Needed after ``model.to(bfloat16)`` (which casts floating buffers too: bf16 angles lose
        precision at large positions) and after ``to_empty()``.
        """
        device = self.tok_embeddings.weight.device
        cos, sin = rotary_tables(self.config.head_dim, self.config.seq_len, self.config.rope_theta)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        _, T = tokens.shape
        if T > self.config.seq_len:
            raise ValueError(f"sequence length {T} exceeds LlamaConfig.seq_len={self.config.seq_len}")
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))  # (B, T, vocab_size)

    def example_inputs(
        self, batch_size: int | None = None, *, device: torch.device | str | None = None
    ) -> tuple[Tensor]:
        """``(tokens,)``: random token ids (batch_size, seq_len) on the model's device.

        Deterministic given ``torch.manual_seed``; works on the meta device.
        """
        batch_size = self.example_batch_size if batch_size is None else batch_size
        device = self.tok_embeddings.weight.device if device is None else device
        tokens = torch.randint(0, self.config.vocab_size, (batch_size, self.config.seq_len), device=device)
        return (tokens,)

    def loss_fn(self, output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
        """Next-token cross-entropy; same contract as :func:`llama_loss`."""
        return llama_loss(output, inputs)


def llama_loss(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross-entropy in float32 (as torchtitan computes it) on logits (B, T, V)."""
    (tokens,) = inputs
    logits = output[:, :-1, :]  # (B, T-1, V)
    targets = tokens[:, 1:]  # (B, T-1)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_llama(
    config: LlamaConfig,
    batch_size: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> tuple[Llama, tuple[Tensor]]:
    """Build a Llama and its example inputs, deterministically, without touching the global RNG.

    ``device="meta"`` builds any size in seconds: parameters get shapes but no storage.
    ``dtype`` casts parameters; the rotary tables stay float32.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device or "cpu"):
            model = Llama(config)
            if dtype is not None:
                model = model.to(dtype=dtype)
                model.reset_rope()
        model.example_batch_size = batch_size
        inputs = model.example_inputs()
    return model, inputs


def llama_tiny(*, device: torch.device | str | None = None, seq_len: int = 32) -> tuple[Llama, tuple[Tensor]]:
    """2 layers, dim 64, 4 query / 2 KV heads, FFN 128, vocab 256, seq 32, batch 2 (CPU-fast)."""
    config = LlamaConfig(
        vocab_size=256, seq_len=seq_len, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128
    )
    return build_llama(config, batch_size=2, device=device)


def llama3_8b(
    *,
    device: torch.device | str | None = "meta",
    seq_len: int = 8192,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Llama, tuple[Tensor]]:
    """Llama 3 8B shapes (32 layers, dim 4096, 32/8 heads, FFN 14336, vocab 128256) on meta."""
    config = LlamaConfig(
        vocab_size=128_256, seq_len=seq_len, n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14_336
    )
    return build_llama(config, batch_size=batch_size, device=device, dtype=dtype)


def llama3_70b(
    *,
    device: torch.device | str | None = "meta",
    seq_len: int = 4096,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Llama, tuple[Tensor]]:
    """Llama 3 70B shapes (80 layers, dim 8192, 64/8 heads, FFN 28672, vocab 128256) on meta.

    About 70.6e9 parameters: 141 GB in bfloat16, so the default device is meta (built in seconds,
    nothing allocated); the estimators convert it to fake tensors.
    """
    config = LlamaConfig(
        vocab_size=128_256, seq_len=seq_len, n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28_672
    )
    return build_llama(config, batch_size=batch_size, device=device, dtype=dtype)


def llama3_405b(
    *,
    device: torch.device | str | None = "meta",
    seq_len: int = 4096,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Llama, tuple[Tensor]]:
    """Llama 3.1 405B shapes (126 layers, dim 16384, 128/8 heads, FFN 53248, vocab 128256) on meta.

    About 405.9e9 parameters: 811 GB in bfloat16, built on meta (nothing allocated).
    """
    config = LlamaConfig(
        vocab_size=128_256, seq_len=seq_len, n_layers=126, dim=16_384, n_heads=128, n_kv_heads=8, ffn_dim=53_248
    )
    return build_llama(config, batch_size=batch_size, device=device, dtype=dtype)
