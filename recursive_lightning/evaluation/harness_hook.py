"""Make ``lm_eval --model recursive_lightning`` work with the installed lm-eval (0.4.x).

lm-eval 0.4.13 finds models only in its own ``lm_eval.models.MODEL_MAPPING`` or in classes registered with
``@register_model`` by modules already imported; it reads no entry points and has no plugin option
(EleutherAI/lm-evaluation-harness issue #3282, PR #3672 unmerged). Two ways in:

* ``python -m recursive_lightning.evaluation.lm_eval_cli <lm_eval arguments>`` imports the adapter, then runs
  lm-eval's own CLI. Always works.
* ``python -m recursive_lightning.evaluation.harness_hook install`` writes ``recursive_lightning_lm_eval.pth``
  into site-packages. At interpreter start it calls :func:`activate`, which waits (an import hook that does
  nothing else) for ``lm_eval.models`` to be imported and then registers every ``lm_eval.models`` entry
  point of the installed distributions (ours: pyproject ``[project.entry-points."lm_eval.models"]``) as a
  lazy ``module:Class`` placeholder in lm-eval's model registry. So the plain ``lm_eval`` / ``lm-eval``
  commands and ``lm_eval.simple_evaluate(model="recursive_lightning")`` find the model, nothing heavy is
  imported before lm-eval asks for it, and the entry-point declaration does what it says.

This module is imported at every interpreter start once the hook is installed: keep it dependency-free.
"""

from __future__ import annotations

import sys

GROUP = "lm_eval.models"
OURS = {"recursive_lightning": "recursive_lightning.evaluation.lm_eval_adapter:RecursiveLightningLM"}
PTH_NAME = "recursive_lightning_lm_eval.pth"
PTH_LINE = (
    "import importlib.util as _u; _u.find_spec('recursive_lightning') is not None and "
    "__import__('recursive_lightning.evaluation.harness_hook', fromlist=['activate']).activate()\n"
)
_TARGET = "lm_eval.models"


def _is_user_error(exc: BaseException) -> bool:
    return any(
        c.__name__ == "UserError" and c.__module__ == "recursive_lightning.errors" for c in type(exc).__mro__
    )


def _excepthook(exc_type, exc, tb, _previous=None) -> None:
    """lm-eval's CLI catches nothing: our one-sentence errors (a missing checkpoint, a bad model_arg) are
    printed as that sentence alone instead of a traceback ending in it; anything else as before."""
    if _is_user_error(exc):
        print(f"error: {exc}", file=sys.stderr)
        return
    (_previous or sys.__excepthook__)(exc_type, exc, tb)


def install_excepthook() -> None:
    if getattr(sys.excepthook, "__name__", "") != "_recursive_lightning_excepthook":
        previous = sys.excepthook

        def _recursive_lightning_excepthook(exc_type, exc, tb):
            _excepthook(exc_type, exc, tb, previous)

        sys.excepthook = _recursive_lightning_excepthook


def register_models() -> list[str]:
    """Register entry-point models (and ours) as lazy placeholders in lm-eval's model registry, and show
    our errors as one sentence (``install_excepthook``)."""
    from lm_eval.api.registry import model_registry  # heavy

    install_excepthook()

    found = dict(OURS)
    try:
        from importlib.metadata import entry_points  # startup

        for ep in entry_points(group=GROUP):
            found.setdefault(ep.name, ep.value)
    except Exception:  # a broken distribution's metadata must not break lm-eval
        pass
    added = []
    for name, target in found.items():
        if name not in model_registry:
            try:
                model_registry.register(name, target=target)
                added.append(name)
            except Exception:  # frozen registry or a clash: leave lm-eval's own state alone
                pass
    return added


class _Loader:
    """Runs the real loader of ``lm_eval.models``, then registers our models."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            register_models()
        except Exception:
            pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Finder:
    """A one-shot meta-path finder that wraps the loader of ``lm_eval.models``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        deactivate()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def activate() -> None:
    """Register now if lm-eval's models are already imported, else when they are."""
    if _TARGET in sys.modules:
        try:
            register_models()
        except Exception:
            pass
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def deactivate() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def site_packages() -> str:
    import sysconfig  # startup

    return sysconfig.get_paths()["purelib"]


def pth_path(site_dir: str | None = None):
    from pathlib import Path  # startup

    return Path(site_dir or site_packages()) / PTH_NAME


def installed(site_dir: str | None = None) -> bool:
    p = pth_path(site_dir)
    return p.is_file() and p.read_text() == PTH_LINE


def install(site_dir: str | None = None):
    """Write the ``.pth`` start-up hook into site-packages (idempotent); returns its path."""
    p = pth_path(site_dir)
    if not installed(site_dir):
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(PTH_LINE)
        tmp.replace(p)
    return p


def uninstall(site_dir: str | None = None) -> bool:
    p = pth_path(site_dir)
    if p.is_file():
        p.unlink()
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else "status"
    if cmd == "install":
        print(f"installed {install()}: `lm_eval --model recursive_lightning` now works in this environment")
    elif cmd == "uninstall":
        print("removed" if uninstall() else "not installed", pth_path())
    elif cmd == "status":
        print(("installed: " if installed() else "not installed: ") + str(pth_path()))
    else:
        print(
            "usage: python -m recursive_lightning.evaluation.harness_hook [install|uninstall|status]",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
