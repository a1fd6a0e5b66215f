"""lm-eval model ``recursive_lightning``: a recursive_lightning checkpoint behind the harness's LM interface.

    lm_eval --model recursive_lightning --model_args checkpoint=runs/x/checkpoints/last.ckpt,batch_size=16 \\
        --tasks lambada_openai,piqa --device cpu

(see ``harness_hook.py`` for how lm-eval finds the name), or in Python::

    lm = RecursiveLightningLM(checkpoint="runs/x")            # .ckpt file or run directory
    lm = RecursiveLightningLM.from_loaded(load_checkpoint(p))  # a model already in memory
    lm_eval.simple_evaluate(model=lm, tasks=[...])

Scoring follows ``perplexity.py`` exactly: the checkpoint's own ``tokenizers.Tokenizer``, ``<|endoftext|>`` as
end-of-text and as the prefix of an empty context / of a rolling document, contexts left-truncated to
``max_length`` tokens, the same windows for ``loglikelihood_rolling`` as ``perplexity.perplexity`` (so the two
agree to float precision), batches sorted by length and right-padded (the models are causal). Continuations of
one context are scored in one packed row (``prefix_sharing.py``; ``prefix_sharing=false`` turns it off).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own placeholders: get_model() imports them only into an empty registry)
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from tqdm import tqdm

from recursive_lightning.errors import UserError
from recursive_lightning.evaluation.perplexity import (
    EOS_TOKEN,
    document_logprobs,
    model_device,
    plan_windows,
    score_sequences,
)
from recursive_lightning.evaluation.prefix_sharing import plan_trees, score_trees
from recursive_lightning.model.decoding import decode

log = logging.getLogger(__name__)
NAME = "recursive_lightning"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _batch_size(value: Any) -> int:
    if value is None:
        return 16
    if isinstance(value, str) and value.startswith("auto"):
        log.info("batch_size=%s: automatic sizing is not implemented, using 16", value)
        return 16
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise UserError(f"batch_size must be a positive integer or 'auto', not {value!r}.") from None
    if n < 1:
        raise UserError(f"batch_size must be a positive integer, not {n}.")
    return n


def _device(value: Any) -> torch.device:
    name = str(value or "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available; using cpu", name)
        name = "cpu"
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"device '{name}' is not a torch device; use cpu, cuda or cuda:N.") from None


def _bars_off() -> bool:
    """Progress bars off: ``TQDM_DISABLE`` set (a sweep's workers set it; their bars interleave in one log)."""
    return os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")


class RecursiveLightningLM(TemplateLM):
    """lm-eval ``LM`` over a ``RecursiveLM`` checkpoint (every model family: vanilla, looped, unshared,
    multi-resolution; every topology)."""

    backend = "causal"

    def __init__(
        self,
        checkpoint: str | None = None,
        device: str | None = "cpu",
        batch_size: int | str | None = 16,
        max_length: int | None = None,
        stride: int | None = None,
        max_gen_toks: int = 256,
        dtype: str | None = None,
        loaded: Any = None,
        max_batch_size: int | None = None,  # passed by lm-eval's CLI; batch sizing is fixed here
        prefix_sharing: bool | str = True,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs:
            log.warning("recursive_lightning ignores unknown model_args: %s", ", ".join(sorted(kwargs)))
        if loaded is None:
            if not checkpoint:
                raise UserError(
                    "the recursive_lightning model needs checkpoint=PATH (a .ckpt file or a run directory)."
                )
            from recursive_lightning.training.checkpoint import load_checkpoint  # heavy

            loaded = load_checkpoint(checkpoint, device="cpu")
        if loaded.tokenizer is None:
            raise UserError(
                f"checkpoint '{loaded.path}' carries no tokenizer, which evaluation needs to turn text into tokens."
            )
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self._device = _device(device)
        if dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise UserError(f"dtype '{dtype}' is unknown; use float32, bfloat16 or float16.")
        self.model.to(self._device)
        from recursive_lightning.training.checkpoint import keep_trained_kernels  # heavy

        keep_trained_kernels(loaded, self._device)  # a run trained with fused memory updates, on a GPU
        if dtype in DTYPES:
            self.model.to(DTYPES[dtype])
        self.model.eval()
        eot = self.tokenizer.token_to_id(EOS_TOKEN)
        if eot is None:
            raise UserError(
                f"the checkpoint's tokenizer has no {EOS_TOKEN} token, which scoring uses as end-of-text."
            )
        self._eot = int(eot)
        context = int(self.model.cfg.max_seq_len)
        if max_length is not None and int(max_length) > context:  # attention's memory grows as its square
            raise UserError(
                f"--max-length {max_length} is above the model's context of {context} tokens (model.max_seq_len); "
                f"pass at most {context}, or measure longer contexts with --context-lengths."
            )
        self._max_length = int(max_length or context)
        self.stride = int(stride) if stride else None
        plan_windows(2, 1, self._max_length, self.stride)  # validates the stride
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = _batch_size(batch_size)
        self.prefix_sharing = str(prefix_sharing).lower() not in ("false", "0", "no")
        self._warned_sampling = False

    @classmethod
    def from_loaded(cls, loaded: Any, **kwargs: Any) -> RecursiveLightningLM:
        """Wrap a ``training.checkpoint.Loaded`` (model, run config, tokenizer) without reading it again."""
        return cls(loaded=loaded, **kwargs)

    # lm-eval's CLI passes batch_size/device next to --model_args; model_args win instead of clashing.
    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict | None = None
    ) -> RecursiveLightningLM:
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict | None = None
    ) -> RecursiveLightningLM:
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # ------------------------------------------------------------------------------------------ properties
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"recursive_lightning:{self.loaded.path}"

    def get_model_info(self) -> dict[str, Any]:
        cfg = self.model.cfg
        return {
            "model_checkpoint": str(self.loaded.path),
            "model_global_step": self.loaded.global_step,
            "model_layout": cfg.layout,
            "model_topology": cfg.topology,
            "model_max_length": self._max_length,
            "model_stride": self.stride or self._max_length,
        }

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: Any, skip_special_tokens: bool = False) -> str:
        if isinstance(tokens, int):
            tokens = [tokens]
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------------------------ scoring
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # TQDM_DISABLE (set by sweep workers and for logs) covers lm-eval's "Tokenizing inputs" bar too: lm-eval
        # passes disable= explicitly, which tqdm's environment defaults do not override
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or _bars_off())

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """Sum of log-probabilities of each continuation given its (left-truncated) context, and whether
        greedy decoding would produce it. A continuation longer than ``max_length`` is scored in windows.

        Continuations of one context (multiple-choice items) share a forward pass when the model allows it
        (``prefix_sharing.py``); ``batch_size`` counts requests either way."""
        fits = [len(ctx) + len(cont) - 1 <= self._max_length for _, ctx, cont in requests]
        trees, alone = [], list(range(len(requests)))
        if self.prefix_sharing and self.batch_size > 1 and getattr(self.model, "packable", False):
            trees, alone = plan_trees(  # a context that must be left-truncated is never shared
                [(ctx, cont) if ok else ((), ()) for (_, ctx, cont), ok in zip(requests, fits)],
                self.batch_size,
                self._max_length,
            )
        scored_reqs: list[tuple[list[int], int]] = []
        owner: list[int] = []
        for r in alone:
            _, ctx, cont = requests[r]
            full = [*ctx, *cont]
            for w in plan_windows(len(full), len(ctx), self._max_length, self.stride):
                scored_reqs.append((full[w.begin : w.end], w.end - w.target))
                owner.append(r)
        bar = tqdm(
            total=len(scored_reqs) + len(requests) - len(alone),
            desc="recursive_lightning loglikelihood",
            disable=disable_tqdm or len(requests) < 2 or _bars_off(),
        )
        shared = score_trees(self.model, trees, self.batch_size, progress=bar.update)
        scored = score_sequences(self.model, scored_reqs, self.batch_size, progress=bar.update)
        bar.close()
        sums = [0.0] * len(requests)
        is_greedy = [True] * len(requests)
        for r, s in [*zip(owner, scored), *shared.items()]:
            sums[r] += s.logprob
            is_greedy[r] = is_greedy[r] and s.greedy
        out = []
        for r, (key, _, _) in enumerate(requests):
            answer = (sums[r], is_greedy[r])
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents: ``[EOS] + tokens`` in the windows of ``perplexity.py``."""
        strings = [req.args[0] for req in requests]
        docs = [self.tok_encode(s) for s in strings]
        scores = document_logprobs(
            self.model, docs, self._eot, self._max_length, self.stride, self.batch_size
        )
        out = []
        for s, (lp, _) in zip(strings, scores):
            self.cache_hook.add_partial("loglikelihood_rolling", (s,), lp)
            out.append(lp)
        return out

    # ------------------------------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding until a stop string (``until``, plus EOS) or ``max_gen_toks`` tokens."""
        eos = self.tok_decode(self._eot)
        groups: dict[str, list[int]] = defaultdict(list)
        plans: dict[str, tuple[list[str], int]] = {}
        contexts: list[list[int]] = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            if (
                kwargs.get("do_sample") or (kwargs.get("temperature") or 0) > 0
            ) and not self._warned_sampling:
                log.warning("recursive_lightning decodes greedily; sampling arguments are ignored")
                self._warned_sampling = True
            until = kwargs.get("until")
            until = [until] if isinstance(until, str) else list(until or [])
            if eos not in until:
                until.append(eos)
            max_new = int(kwargs.get("max_gen_toks") or self.max_gen_toks)
            key = json.dumps([until, max_new])
            groups[key].append(i)
            plans[key] = (until, max_new)
            ctx = self.tok_encode(context) or [self._eot]
            contexts.append(ctx[-max(1, self._max_length - max_new) :])
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(
            total=len(requests),
            desc="recursive_lightning generate_until",
            disable=disable_tqdm or _bars_off(),
        )
        for key, idx in groups.items():
            until, max_new = plans[key]
            idx = sorted(idx, key=lambda i: -len(contexts[i]))
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s : s + self.batch_size]
                texts = self._greedy([contexts[i] for i in chunk], until, max_new)
                for i, text in zip(chunk, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _greedy(self, contexts: list[list[int]], until: list[str], max_new: int) -> list[str]:
        """Greedy continuations of ``contexts``, decoded with the model's cache (``model/decoding.py``);
        contexts of equal length decode together, and a row stops at EOS or once a stop string appears."""
        device = model_device(self.model)
        gen: list[list[int]] = [[] for _ in contexts]
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, c in enumerate(contexts):
            by_length[len(c)].append(i)
        for rows in by_length.values():
            x = torch.as_tensor([contexts[i] for i in rows], dtype=torch.long, device=device)
            tokens = decode(self.model, x, max_new, window=self._max_length)
            active = set(range(len(rows)))
            for nxt in tokens:
                for r, t in enumerate(nxt.tolist()):
                    if r not in active:
                        continue
                    i = rows[r]
                    if t == self._eot:
                        active.discard(r)
                        continue
                    gen[i].append(t)
                    if any(u and u in self.tok_decode(gen[i]) for u in until):
                        active.discard(r)
                if not active:
                    break
        texts = []
        for g in gen:
            text = self.tok_decode(g)
            cut = min((text.find(u) for u in until if u and u in text), default=-1)
            texts.append(text[:cut] if cut >= 0 else text)
        return texts


def _register() -> None:
    try:
        model_registry.register(NAME)(RecursiveLightningLM)
    except ValueError:  # the name already points at another class; leave lm-eval's registry alone
        log.warning("lm-eval model name '%s' is taken by another class", NAME)


_register()
