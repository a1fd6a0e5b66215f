"""One typed model config: a size preset plus a layout, topology and resolution options.

Presets carry the public Pythia dimensions (GPT-NeoX: parallel attention+MLP residual, LayerNorm,
GELU MLP of 4d, rotary on 25% of head dims, untied embeddings, vocab 50304) and small CPU sizes.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from recursive_lightning.errors import ConfigError
from recursive_lightning.model.layout import Layout, parse_layout
from recursive_lightning.strict_yaml import StrictYAMLError, parse_yaml

# name -> (layers, hidden, heads); all Pythia sizes share the GPT-NeoX recipe.
PYTHIA = {
    "pythia-160m": (12, 768, 12),
    "pythia-410m": (24, 1024, 16),
    "pythia-1b": (16, 2048, 8),
    "pythia-1.4b": (24, 2048, 16),
    "pythia-2.8b": (32, 2560, 32),
    "pythia-6.9b": (32, 4096, 32),
}
# Small sizes that train on a 2-core CPU in minutes (vocab matches the default `bpe:4096` tokenizer).
CPU = {
    "cpu-tiny": (8, 64, 4),
    "cpu-small": (8, 128, 4),
    "cpu-base": (12, 256, 8),
}
PRESETS: dict[str, dict[str, Any]] = {
    **{
        k: {"n_layers_hint": n, "d_model": d, "n_heads": h, "vocab_size": 50304, "max_seq_len": 2048}
        for k, (n, d, h) in PYTHIA.items()
    },
    **{
        k: {"n_layers_hint": n, "d_model": d, "n_heads": h, "vocab_size": 4096, "max_seq_len": 1024}
        for k, (n, d, h) in CPU.items()
    },
}

# Transformer++ (LLaMA: RMSNorm, SwiGLU, full rotary, GQA, no biases) and Mela (arch: mela), Mela Table 1.
# Decoder depth, heads and memory shape are not in the table: our fit (MELA_SIZES below, docs/models.md).
LLAMA = {
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "rotary_pct": 1.0,
    "bias": False,
    "parallel_residual": False,
    "scale_embeddings": False,
    "tie_embeddings": True,
    "rotary_base": 10000.0,
}
MELA_SIZES = {
    # name: (H-module layers, L-module layers, HMM hidden, decoder hidden, decoder layers, heads, kv heads)
    "400m": (8, 4, 768, 768, 38, 12, 4),
    "800m": (8, 8, 1024, 1024, 46, 16, 4),
    "1.2b": (8, 8, 1024, 1536, 38, 24, 8),
}
PRESETS.update(
    {
        f"mela-{k}": {
            **LLAMA,
            "arch": "mela",
            "h_layers": h,
            "l_layers": lo,
            "hmm_d_model": dh,
            "hmm_heads": dh // 64,
            "d_model": d,
            "n_layers_hint": n,
            "n_heads": nh,
            "n_kv_heads": kv,
            "vocab_size": 32000,
            "max_seq_len": 4096,
        }
        for k, (h, lo, dh, d, n, nh, kv) in MELA_SIZES.items()
    }
)
# Transformer++ matched to each Mela size: the same decoder, deeper to take the memory's parameters
TRANSFORMERPP_LAYERS = {"400m": 54, "800m": 66, "1.2b": 48}
PRESETS.update(
    {
        f"transformerpp-{k}": {
            **LLAMA,
            "d_model": d,
            "n_layers_hint": TRANSFORMERPP_LAYERS[k],
            "n_heads": nh,
            "n_kv_heads": kv,
            "vocab_size": 32000,
            "max_seq_len": 4096,
        }
        for k, (_, _, _, d, _, nh, kv) in MELA_SIZES.items()
    }
)
# CPU sizes: train in minutes here (P=8, C=8: a 64-token chunk, 8 memory tokens)
PRESETS["cpu-mela"] = {
    **LLAMA,
    "arch": "mela",
    "d_model": 128,
    "n_heads": 4,
    "n_kv_heads": 2,
    "n_layers_hint": 4,
    "vocab_size": 4096,
    "max_seq_len": 1024,
    "h_layers": 2,
    "l_layers": 1,
    "h_cycles": 2,
    "l_cycles": 2,
    "patch_size": 8,
    "chunk_size": 8,
    "memory_heads": 4,
    "memory_expansion": 2,
}
PRESETS["cpu-transformerpp"] = {
    **LLAMA,
    "d_model": 128,
    "n_heads": 4,
    "n_kv_heads": 2,
    "n_layers_hint": 9,
    "vocab_size": 4096,
    "max_seq_len": 1024,
}

ARCHES = ("recursive", "mela")
MEMORY_UPDATES = ("plain", "momentum", "forgetting", "newton_schulz")  # Eq. 1, Eqs. 2-3, Eqs. 4-5, Eqs. 10-11
FUSIONS = ("mlp", "weighted_sum", "none")  # Sec. 3.3 / Table 4

TOPOLOGY_TERMS = ("residual", "anchor", "anchor_emb")
TOPOLOGIES = (
    "base",
    "residual",
    "anchor",
    "anchor_emb",
    "residual+anchor",
    "residual+anchor+anchor_emb",
    "anchor+anchor_emb",
    "static",
    "dynamic",
    "mesh",
)


def _choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        hint = difflib.get_close_matches(str(value), options, n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"model.{name} '{value}' is unknown{extra}; choose one of: {', '.join(options)}.")


def normalize_topology(name: str) -> str:
    """Canonical name; '+' combinations of residual/anchor/anchor_emb in any order, 'anchor*' = anchor_emb."""
    name = str(name).strip().replace("anchor*", "anchor_emb").replace(" ", "")
    parts = name.split("+")
    if len(parts) > 1 and all(p in TOPOLOGY_TERMS for p in parts) and len(set(parts)) == len(parts):
        return "+".join(t for t in TOPOLOGY_TERMS if t in parts)
    return name


# fields that act on one family only (ModelConfig.resolved leaves the others out)
_MULTIRES_FIELDS = ("downscale", "upscale", "offset", "shift", "gain", "allow_noncausal")
_RECURSIVE_FIELDS = ("topology", "buffer", "mesh_transition_input", *_MULTIRES_FIELDS)
_MELA_FIELDS = (
    "patch_size", "chunk_size", "h_cycles", "l_cycles", "h_layers", "l_layers", "hmm_d_model", "hmm_heads",
    "memory_heads", "memory_depth", "memory_expansion", "memory_update", "ns_steps", "memory_read", "memory_carry",
    "memory_max_lr", "memory_step_floor", "hmm_attention", "hmm_gate", "neural_memory", "fusion", "memstack",
)  # fmt: skip


def _written_before_step_floor(data: dict[str, Any]) -> bool:
    """A complete Mela model dict (``to_dict`` writes every field, ``n_layers_hint`` among them, which no user
    file states) without ``memory_step_floor``: a checkpoint or ``config.yaml`` written before the field existed,
    whose memory took Eq. 10's unbounded step. It keeps that function (floor 0) when it loads or resumes."""
    complete = "n_layers_hint" in data and all(
        name in data for name in _MELA_FIELDS if name != "memory_step_floor"
    )
    return complete and data.get("arch") == "mela" and "memory_step_floor" not in data


def _check_mela_layout(layout: object) -> None:
    """One sentence when a Mela layout is not a layer count: the decoder is a plain stack of layers, so the
    recursive grammar (prelude+core+coda, loops, resolutions) and its hints do not apply."""
    text = str(layout).replace(" ", "")
    if re.fullmatch(r"\d+", text):
        return  # a layer count; parse_layout refuses 0
    if "+" in text:
        what = "is a prelude-core-coda layout"
    elif re.fullmatch(r"\d+(R\d+|[x×]\{.*\})", text):
        what = "is a looped core"
    else:
        what = "is not a layer count"
    raise ConfigError(
        f"model.layout '{layout}' {what}, but a Mela decoder is a plain stack: give its depth as "
        "a whole number of layers, e.g. 12."
    )


@dataclass
class ModelConfig:
    """Everything that defines a model's architecture. Serialises to and from YAML."""

    preset: str | None = None
    layout: str = "12"
    vocab_size: int = 50304
    d_model: int = 768
    n_heads: int = 12
    n_kv_heads: int | None = None  # grouped-query attention when < n_heads
    mlp: str = "gelu"  # gelu (GPT-NeoX) | swiglu (LLaMA)
    mlp_hidden: int | None = None  # default 4 d for gelu, 8/3 d rounded to 64 for swiglu
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    bias: bool = True
    parallel_residual: bool = True
    rotary_pct: float = 0.25
    rotary_base: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    scale_embeddings: bool = True  # h_emb = sqrt(d) * E[x] (MeSH App. B); False for stock Pythia
    init_std: float = 0.02
    depth_init: bool = True  # output projections std / sqrt(2 N_compute) (MeSH App. B)
    # --- recurrence topology (MeSH Sec. 3) ---
    topology: str = "base"
    buffer: int | None = None  # MeSH slots B; default N_loop + 3 (MeSH App. E.2)
    # transitional routers read the prelude output (MeSH Alg. 2, line 9) or the embeddings (SpiralFormer Eq. 25)
    mesh_transition_input: str = "prelude"
    # --- multi-resolution recursion (SpiralFormer Sec. 2.3) ---
    downscale: str = "self_aggregation"  # self_aggregation | mean
    upscale: str = "allocation"  # allocation | broadcast
    offset: Any = "half"  # half (floor(g/2)) | zero | int | list per step
    shift: Any = "overlap"  # overlap (g-1) | parallel (g) | int | list per step
    gain: Any = "sqrt"  # sqrt (sqrt(g)) | float
    allow_noncausal: bool = False  # permit s <= g-2 (Prop. 1) only to demonstrate the leak
    # --- model family ---
    # recursive: RecursiveLM (vanilla incl. Transformer++, looped, multi-resolution); mela: MelaLM, whose
    # layout is the decoder depth (a plain integer)
    arch: str = "recursive"
    # --- Mela (arch: mela; Mela Secs. 2-4, Table 1) ---
    patch_size: int = 32  # P: tokens per patch (1-D convolution, kernel = stride = P)
    chunk_size: int = 64  # C: patches per memory update = memory tokens per decoder chunk of P*C tokens
    h_cycles: int = 4  # H: high-level cycles of HLR (the first H-1 without gradients)
    l_cycles: int = 4  # L: L-module refinements per H cycle
    h_layers: int = 8  # memory blocks of the H-module
    l_layers: int = 4  # memory blocks of the L-module
    hmm_d_model: int | None = None  # HMM hidden size (default d_model)
    hmm_heads: int | None = None  # gated-attention heads in the HMM (default n_heads)
    memory_heads: int = 4  # neural-memory heads (each an independent memory MLP on d/heads dims)
    memory_depth: int = 2  # layers of the memory MLP N(.; M)
    memory_expansion: int = 2  # hidden width of the memory MLP, in multiples of its head dim
    memory_update: str = (
        "newton_schulz"  # plain (Eq. 1) | momentum (2-3) | forgetting (4-5) | newton_schulz (10-11)
    )
    ns_steps: int = 5  # k of Newton-Schulz-k (Eq. 10)
    # [reading] the HMM output at chunk t retrieves from the memory after (M_t) or before (M_{t-1}, Eq. 9
    # literally) that chunk's update; decoder chunk t+1 reads it (neural_memory.py explains the choice)
    memory_read: str = "after"
    # [reading] which fast-weight state a memory block application starts from (hierarchical_memory.py):
    # cycles (one memory per block, carried through the H x L cycles chunk by chunk: consolidation
    # accumulates, Sec. 3.2) | none (every application scans from its block's M_0)
    memory_carry: str = "cycles"
    # [reading] theta = memory_max_lr * sigmoid(.) (Titans' max_lr); Eqs. 1-5 diverge without a bound
    memory_max_lr: float = 0.01
    # [reading] Eq. 10's Newton-Schulz step times min(1, ||S_t|| / (memory_step_floor * sum theta * ||M||)):
    # unit singular values while the surprise is large, shrinking with it (neural_memory.step_floors); 0: Eq. 10
    memory_step_floor: float = 12.0
    hmm_attention: bool = True  # gated attention in every memory block (Table 4 "attention in memory module")
    hmm_gate: bool = True  # its sigmoid output gate (Qiu et al. 2025; Table 4 "gating")
    neural_memory: bool = True  # the neural memory in every memory block (Table 4)
    fusion: str = "mlp"  # dual-memory fusion (Sec. 3.3): mlp | weighted_sum | none (h only)
    memstack: bool = True  # z(1..H-1) added at the memory rows of the first H-1 decoder layers (Eq. 13)
    n_layers_hint: int | None = field(default=None, repr=False)  # the preset's depth (default layout)

    # ------------------------------------------------------------------ derived
    @property
    def parsed_layout(self) -> Layout:
        return parse_layout(self.layout)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.mlp == "swiglu":
            return 64 * -(-int(8 * self.d_model / 3) // 64)
        return 4 * self.d_model

    @property
    def buffer_slots(self) -> int:
        return self.buffer if self.buffer is not None else self.parsed_layout.n_loop + 3

    def offsets(self) -> list[int]:
        return self._per_step("offset", self.offset, {"half": lambda g: g // 2, "zero": lambda g: 0})

    def shifts(self) -> list[int]:
        return self._per_step("shift", self.shift, {"overlap": lambda g: g - 1, "parallel": lambda g: g})

    def gains(self) -> list[float]:
        chunk = self.parsed_layout.chunk
        if self.gain == "sqrt":
            return [g**0.5 for g in chunk]
        return [float(self.gain)] * len(chunk)

    def _per_step(self, name: str, value: Any, named: dict) -> list[int]:
        chunk = self.parsed_layout.chunk
        if isinstance(value, str):
            if value in named:
                return [named[value](g) for g in chunk]
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(
                    f"model.{name} '{value}' is unknown; use {' / '.join(named)}, an integer or a list per loop step."
                ) from None
        if isinstance(value, bool) or not isinstance(value, int | list | tuple):
            raise ConfigError(
                f"model.{name} must be {' / '.join(named)}, an integer or a list, not {value!r}."
            )
        values = list(value) if isinstance(value, list | tuple) else [value] * len(chunk)
        if len(values) != len(chunk):
            raise ConfigError(
                f"model.{name} lists {len(values)} values but the layout has {len(chunk)} loop steps."
            )
        return [int(v) for v in values]

    @property
    def hmm_width(self) -> int:
        return self.hmm_d_model or self.d_model

    @property
    def hmm_n_heads(self) -> int:
        return self.hmm_heads or self.n_heads

    @property
    def tokens_per_chunk(self) -> int:
        """P * C: text tokens of one decoder chunk (Mela Sec. 4.1)."""
        return self.patch_size * self.chunk_size

    # ------------------------------------------------------------------ validation
    def validate(self) -> ModelConfig:
        _choice("arch", self.arch, ARCHES)
        if self.arch == "mela":
            _check_mela_layout(self.layout)  # before the recursive grammar, whose hints do not apply to Mela
        lay = self.parsed_layout
        if self.arch == "mela":
            self._validate_mela()
        self.topology = normalize_topology(self.topology)
        _choice("topology", self.topology, TOPOLOGIES)
        _choice("mlp", self.mlp, ("gelu", "swiglu"))
        _choice("norm", self.norm, ("layernorm", "rmsnorm"))
        _choice("downscale", self.downscale, ("self_aggregation", "mean"))
        _choice("upscale", self.upscale, ("allocation", "broadcast"))
        _choice("mesh_transition_input", self.mesh_transition_input, ("prelude", "embedding"))
        for name in ("vocab_size", "d_model", "n_heads", "max_seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.{name} must be a positive integer, not {v!r}.")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model {self.d_model} must be divisible by model.n_heads {self.n_heads}."
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"model.n_kv_heads {self.kv_heads} must divide model.n_heads {self.n_heads}.")
        if not 0 <= self.rotary_pct <= 1:
            raise ConfigError(f"model.rotary_pct {self.rotary_pct} must lie in [0, 1].")
        heads = [("model.d_model / model.n_heads", self.head_dim)]
        if self.arch == "mela":
            heads.append(("model.hmm_d_model / model.hmm_heads", self.hmm_width // self.hmm_n_heads))
        for what, hd in heads:
            if int(hd * self.rotary_pct) % 2:
                raise ConfigError(
                    f"{what} gives heads of {hd} dims, whose rotary part ({hd} x rotary_pct {self.rotary_pct}) is "
                    "odd; rotary pairs dimensions: choose sizes with an even head dim."
                )
        if lay.kind == "vanilla" and self.topology != "base":
            raise ConfigError(
                f"model.topology '{self.topology}' needs a recurrent layout; '{self.layout}' is vanilla "
                "(use e.g. 4+8R2+4, or 4+8+8+4 for distinct cores with the topology at block boundaries)."
            )
        if self.buffer is not None and (
            isinstance(self.buffer, bool) or not isinstance(self.buffer, int) or self.buffer < 1
        ):
            raise ConfigError(f"model.buffer must be an integer >= 1 (MeSH slots B), not {self.buffer!r}.")
        if self.buffer is not None and self.topology != "mesh":
            raise ConfigError(
                f"model.buffer is set but model.topology is '{self.topology}'; only mesh has a buffer."
            )
        if self.gain != "sqrt":
            try:
                float(self.gain)
            except (TypeError, ValueError):
                raise ConfigError(f"model.gain must be 'sqrt' or a number, not {self.gain!r}.") from None
        for t, (g, w, s) in enumerate(zip(lay.chunk, self.offsets(), self.shifts())):
            if not 0 <= w < g:
                raise ConfigError(
                    f"model.offset {w} at loop step {t} must lie in [0, g) = [0, {g}) (SpiralFormer Eq. 12)."
                )
            if s < 0:
                raise ConfigError(f"model.shift {s} at loop step {t} must be >= 0.")
            if s <= g - 2 and not self.allow_noncausal:
                raise ConfigError(
                    f"model.shift {s} at loop step {t} (chunk size g={g}) breaks causality: SpiralFormer "
                    f"Proposition 1 needs s >= g-1 = {g - 1}; use shift 'overlap' (g-1) or 'parallel' (g)."
                )
        return self

    def _validate_mela(self) -> None:
        lay = self.parsed_layout  # a plain stack: validate() checked the layout is a layer count
        if self.topology != "base":
            raise ConfigError(
                f"model.topology '{self.topology}' does not apply to model.arch mela; leave it base."
            )
        _choice("memory_update", self.memory_update, MEMORY_UPDATES)
        _choice("fusion", self.fusion, FUSIONS)
        _choice("memory_read", self.memory_read, ("after", "before"))
        _choice("memory_carry", self.memory_carry, ("cycles", "none"))
        if not 0 < self.memory_max_lr < float("inf"):
            raise ConfigError(f"model.memory_max_lr must be a positive number, not {self.memory_max_lr!r}.")
        floor = self.memory_step_floor
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor < float("inf"):
            raise ConfigError(
                f"model.memory_step_floor must be a number >= 0 (0: Eq. 10's unbounded Newton-Schulz step), not "
                f"{self.memory_step_floor!r}."
            )
        for name in (
            "patch_size",
            "chunk_size",
            "h_cycles",
            "l_cycles",
            "h_layers",
            "l_layers",
            "memory_heads",
            "memory_depth",
            "memory_expansion",
            "ns_steps",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.{name} must be a positive integer, not {v!r}.")
        if self.hmm_width % self.hmm_n_heads:
            raise ConfigError(
                f"model.hmm_d_model {self.hmm_width} must be divisible by model.hmm_heads {self.hmm_n_heads}."
            )
        if self.fusion == "none" and self.hmm_width != self.d_model:
            raise ConfigError(
                f"model.fusion 'none' passes the h state to the decoder as it is (Sec. 3.3, parameter-free), so "
                f"model.hmm_d_model {self.hmm_width} must equal model.d_model {self.d_model}; set them equal or "
                "use fusion mlp or weighted_sum."
            )
        if self.hmm_width % self.memory_heads:
            raise ConfigError(
                f"model.hmm_d_model {self.hmm_width} must be divisible by model.memory_heads {self.memory_heads}."
            )
        if not (self.hmm_attention or self.neural_memory):
            raise ConfigError(
                "model.hmm_attention and model.neural_memory are both false: a memory block needs at least one."
            )
        if self.memstack and lay.n_layers < self.h_cycles - 1:
            raise ConfigError(
                f"model.layout '{self.layout}' gives the decoder {lay.n_layers} layers, but MemStack adds z(1..H-1) to "
                f"the first H-1 = {self.h_cycles - 1} (Eq. 13); use at least {self.h_cycles - 1} layers, fewer "
                "h_cycles, or memstack false."
            )

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ModelConfig:
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            hint = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(f"model.{unknown[0]} is not a model field{extra}.")
        if _written_before_step_floor(data):
            data["memory_step_floor"] = 0.0  # the function that model was trained as: Eq. 10 literally
        base: dict[str, Any] = {}
        preset = data.get("preset")
        if preset is not None:
            if preset not in PRESETS:
                hint = difflib.get_close_matches(str(preset), list(PRESETS), n=1)
                extra = f" (did you mean '{hint[0]}'?)" if hint else ""
                raise ConfigError(
                    f"model.preset '{preset}' is unknown{extra}; choose one of: {', '.join(PRESETS)}."
                )
            base = dict(PRESETS[preset])
            base["layout"] = str(base["n_layers_hint"])
        merged = {**base, **{k: v for k, v in data.items() if not (k == "layout" and v is None)}}
        if merged.get("layout") is None:
            merged.pop("layout", None)  # no preset: the dataclass default
        if "layout" in merged:
            merged["layout"] = str(merged["layout"])
        return cls(**merged).validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved(self) -> dict[str, Any]:
        """The fields that shape this model, with every default resolved (MeSH's buffer N_loop + 3, the MLP
        width, the KV heads, the HMM width): what a run logs as its ``model.*`` params. Fields of the other
        family (Mela's for a recursive model and back), multi-resolution fields of a single-resolution layout
        and the buffer of a topology without one are left out: they do not act on this model."""
        out = {k: v for k, v in self.to_dict().items() if k != "n_layers_hint"}
        out.update(n_kv_heads=self.kv_heads, mlp_hidden=self.hidden)
        drop = set(_RECURSIVE_FIELDS if self.arch == "mela" else _MELA_FIELDS)
        if self.arch == "mela":
            out.update(hmm_d_model=self.hmm_width, hmm_heads=self.hmm_n_heads)
        else:
            if self.parsed_layout.kind != "multires":
                drop |= set(_MULTIRES_FIELDS)
            if self.topology == "mesh":
                out["buffer"] = self.buffer_slots
            else:
                drop |= {"buffer", "mesh_transition_input"}
        return {k: v for k, v in out.items() if k not in drop}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ModelConfig:
        try:  # duplicate keys and YAML 1.1's ambiguous scalars refused, as in run configs
            data = parse_yaml(Path(path).read_text(encoding="utf-8"), f"model file '{path}'") or {}
        except StrictYAMLError as e:
            raise ConfigError(str(e)) from None
        return cls.from_dict(data.get("model", data))


def preset(name: str, **overrides: Any) -> ModelConfig:
    """``preset("pythia-1.4b", layout="4+8R2+4", topology="mesh")``."""
    return ModelConfig.from_dict({"preset": name, **overrides})
