"""Evaluation of checkpoints: perplexity (``perplexity``), the lm-eval model ``recursive_lightning``
(``lm_eval_adapter``; how lm-eval finds it: ``harness_hook``), and the ``eval`` command (``run``).

Kept import-free: ``harness_hook`` is imported at every interpreter start once its ``.pth`` is installed.
"""
