"""``custom_dataset`` of the embedded tasks' lm-eval configs (this folder): the items of
``recursive_lightning.data.embedded_tasks``, built from the embedded corpus's held-out documents and cached.

lm-eval passes the task's ``metadata`` (plus ``TaskManager(metadata=...)`` / ``--metadata``) as keyword arguments:
``cache_dir`` picks the cache folder (default ``$RECURSIVE_LIGHTNING_CACHE`` or ``~/.cache/recursive_lightning``).
"""

from __future__ import annotations

from typing import Any

from recursive_lightning.data.embedded_tasks import LASTWORD, NEXTSENT, dataset_dict


def lastword(**kwargs: Any) -> Any:
    return dataset_dict(LASTWORD, **kwargs)


def nextsent(**kwargs: Any) -> Any:
    return dataset_dict(NEXTSENT, **kwargs)
