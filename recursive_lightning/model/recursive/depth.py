"""Test-time depth: a looped model run for K' loop steps where it was trained with K (Huginn's
recurrent depth). The same shared core runs more (or fewer) times; what a step's *own* parameters are past the
trained K is the extrapolation rule of each topology, our reading (neither MeSH nor SpiralFormer runs a model
at another depth than it was trained with):

- ``base`` / ``residual`` / ``anchor`` / ``anchor*`` (and their sums): no per-step parameters, they extend as
  they are (MeSH Alg. 1: h^(t+1) = f_core(h^(t)) + h_sup for every t).
- ``static`` / ``dynamic``: loop step t >= K reuses step K-1's combination coefficients (MeSH App. E.3 has one
  set per step).
- ``mesh``: loop step t >= K reuses the last loop step's write and read routers (Eq. 3), and the buffer keeps
  its B slots (B = N_loop + 3 at the trained N_loop, the routers' width): every extra step writes its update
  into the same slots (Eq. 5) and reads the next state from them (Eq. 6), as the trained steps do. No slot is
  dropped or recycled, so nothing a step wrote is lost.
- multi-resolution (SpiralFormer): K' > K repeats the last step of the schedule (its chunk size g, offset,
  shift and gain, and its learned S_down / S_up: in the paper's schedules the last step is at full
  resolution); K' < K runs the schedule's first K' steps.
- distinct cores (``4+8+8+4``) and vanilla layouts have no shared core to loop: refused.

``loop_plan(layout, k)[t]`` is the trained step whose parameters loop step t uses; ``RecursiveLM.loops``
(None: the trained K) selects k, ``RecursiveLM.backprop_loops`` truncates backpropagation to the last loop
steps (training with a sampled number of loops).
"""

from __future__ import annotations

from recursive_lightning.errors import UserError
from recursive_lightning.model.layout import Layout


def check_loops(layout: Layout, k: object, what: str = "--loops") -> int:
    """``k`` as a loop count for ``layout``, or one sentence naming ``what`` and the fix."""
    if layout.kind in ("vanilla", "unshared"):
        has = "no loop" if layout.kind == "vanilla" else "distinct cores, each applied once,"
        raise UserError(
            f"{what}: layout '{layout.text}' has {has} and no shared core to loop; test-time depth needs a "
            "looped layout such as 4+8R2+4 or 4+8x{1/4,1/2,1}+4."
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserError(f"{what} must be whole loop counts >= 1, not {k!r}; e.g. {what} 1,2,4,8.")
    return k


def loop_plan(layout: Layout, k: int | None = None) -> list[int]:
    """For loop steps t = 0..k-1 (``k`` None: the trained K), the trained step whose parameters step t uses."""
    n = layout.n_loop
    if k is None or k == n:
        return list(range(n))
    check_loops(layout, k)
    return [min(t, n - 1) for t in range(k)]
