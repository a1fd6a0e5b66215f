"""``python -m recursive_lightning.evaluation.lm_eval_cli <lm_eval arguments>``: lm-eval's own CLI with the
``recursive_lightning`` model registered (works without the start-up hook of ``harness_hook``)::

    python -m recursive_lightning.evaluation.lm_eval_cli --model recursive_lightning \\
        --model_args checkpoint=runs/x/checkpoints/last.ckpt --tasks lambada_openai --device cpu
"""

from __future__ import annotations

import sys

from recursive_lightning.errors import UserError
from recursive_lightning.evaluation.harness_hook import register_models


def main(argv: list[str] | None = None) -> int:
    # lm-eval's own placeholders first, then ours
    import lm_eval.models  # noqa: F401  # heavy

    register_models()
    from lm_eval.__main__ import cli_evaluate  # heavy

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except UserError as e:  # one sentence, no traceback (a missing checkpoint, a bad model_arg)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
