"""Evaluation of checkpoints: perplexity (``perplexity``), lm-eval downstream tasks (``downstream``), the lm-eval
model ``recursive_lightning`` (``lm_eval_adapter``; how lm-eval finds it: ``harness_hook``), the evaluation of a
checkpoint (``run``) as ``options`` say, and the ``eval`` command (``cli``).

Kept import-free: ``harness_hook`` is imported at every interpreter start once its ``.pth`` is installed.
"""
