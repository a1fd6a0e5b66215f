"""The MLflow app ``recursive-lightning``: MLflow's own server plus one page that opens the classic view.

``ui`` serves a run directory with ``mlflow server --app-name recursive-lightning`` (MLflow's app plugins, the
``mlflow.app`` entry point that ``basic-auth`` also uses); a shared tracking server gets it the same way. The app
is MLflow's server unchanged, with one more route, ``/recursive-lightning/classic#<page>``: a page that stores
MLflow's own "Model training" choice for this address (what its side bar's GenAI / Model training switch
stores, the browser's local storage ``mlflow.workflowType_v1``), marks MLflow's Assistant panel as already
shown and closed (what closing it stores: ``mlflow.assistant.fab.autoOpenedOnFirstLoad_v1``,
``mlflow.assistant.panelOpen_v1``; on a first visit MLflow 3.17 opens it over a quarter of the window, where
the runs table's cost columns would be) and then opens ``<page>``.

Why: MLflow 3.17 picks its GenAI or classic view from the link's ``workflowType`` parameter, else from that
stored choice, GenAI when none is stored, whatever the experiment's kind tag says. The links ``ui`` prints
carry the parameter, but the links inside MLflow's runs table do not: without a stored choice, a run opened
from the table lands in the GenAI view. Every link ``ui`` prints goes through this page first.
"""

from __future__ import annotations

from typing import Any

APP_NAME = "recursive-lightning"  # mlflow server --app-name (pyproject: [project.entry-points."mlflow.app"])
CLASSIC_PAGE = "/recursive-lightning/classic"
WORKFLOW_KEY = "mlflow.workflowType_v1"  # MLflow 3.17's useLocalStorage key: `${key}_v${version}`, JSON value
CLASSIC = "machine_learning"
# MLflow 3.17's Assistant: opened once on a first visit unless this is stored; its open/closed state
ASSISTANT_SHOWN_KEY = "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1"
ASSISTANT_OPEN_KEY = "mlflow.assistant.panelOpen_v1"

_PAGE = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>MLflow (classic view)</title></head>
<body>
<script>
  try {{
    window.localStorage.setItem("{WORKFLOW_KEY}", JSON.stringify("{CLASSIC}"));
    window.localStorage.setItem("{ASSISTANT_SHOWN_KEY}", "true");
    window.localStorage.setItem("{ASSISTANT_OPEN_KEY}", "false");
  }} catch (e) {{}}
  var root = window.location.pathname.slice(0, -"{CLASSIC_PAGE}".length) + "/";
  window.location.replace(root + (window.location.hash || "#/"));
</script>
<noscript><a href="./../">Open MLflow</a></noscript>
</body></html>
"""


def create_app() -> Any:
    """The ASGI app ``mlflow server --app-name recursive-lightning`` runs (a factory, as MLflow's own
    ``basic-auth`` app is): MLflow's Flask app with the classic view's page added, behind MLflow's FastAPI
    app."""
    from mlflow.server import app  # heavy
    from mlflow.server.fastapi_app import create_fastapi_app  # heavy

    def classic_page() -> Any:  # store the classic view's choice, then open the link's fragment
        return app.response_class(_PAGE, mimetype="text/html", headers={"Cache-Control": "no-store"})

    if CLASSIC_PAGE not in {rule.rule for rule in app.url_map.iter_rules()}:
        app.add_url_rule(CLASSIC_PAGE, "recursive_lightning_classic", classic_page, methods=["GET"])
    return create_fastapi_app(app)
