"""What a probe capture holds: :class:`ProbeSettings` (the probes' knobs) and :class:`Capture` (the per-sample
statistics :func:`recursive_lightning.probes.capture.capture` returns), apart from the capture itself so that the
metric modules name the type without importing the module that imports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class ProbeSettings:
    """Knobs of the probes (defaults follow the papers)."""

    kernel: str = "rbf"  # CKA kernel (MeSH: RBF)
    sigma_frac: float = 1.0  # RBF bandwidth = sigma_frac * median pairwise distance
    cka_tokens: int | None = None  # None/0: all tokens of each sequence
    spectrum_k: int = 50  # MeSH Fig. 5: top 50
    subspace_k: int | None = None  # shared-subspace curve length; default min(d, 128)
    token_index: int | None = None  # None: 27 (MeSH Fig. 11's case-study token), clipped to L - 1
    attention: bool = True  # attention probes (only for layouts with a loop-shared core)
    batch_size: int = 16
    lam_gamma: float = 32.0  # SpiralFormer Eq. 23
    max_gram_bytes: int = 256 * 2**20  # CKA is computed in sample chunks whose Grams fit in this


@dataclass
class Capture:
    """Per-sample probe statistics (float64, CPU); sample index first."""

    n_samples: int
    seq_len: int
    d_model: int
    n_loop: int
    block_names: list[str]  # trace names: prelude, core 1..K, coda (zero-layer blocks dropped)
    state_names: list[str]  # h_emb, h(0) .. h(K), h_out
    skew: Tensor  # [N, blocks]
    cka: Tensor  # [N, S, S]
    spectra: Tensor  # [N, S, k]
    effective_rank: Tensor  # [N, S]
    subspace: Tensor | None = None  # [N, K+1, k] over h(0..K); None without loop steps
    routing: dict[str, Tensor] | None = None  # MeSH: write/read/comp x seq/tok, [N, K+1, B or K+2]
    coefficients: Tensor | None = None  # static/dynamic: [N, K, 4]
    attention: dict[str, Tensor] | None = None  # entropy/lam: [N, T, layers, heads]
    attention_loops: list[int] = field(default_factory=list)  # loop step index of each T entry
    attention_chunk: list[int] = field(default_factory=list)  # chunk size g_t per T entry
    attention_window: list[int] = field(default_factory=list)  # LAM window M_t per T entry
    token_index: int = 0
    cka_positions: int = 0  # tokens per sample used for CKA
    seconds: float = 0.0
