"""``python -m recursive_lightning ui [RUN_DIR]``: the MLflow UI of a run or sweep directory, wherever it lies now
(``tracking/ui.py``: finding its store, pointing its artifact locations at the directory's current place,
``mlflow server``); a store behind its own tracking server: that server's address and links."""

from __future__ import annotations

import signal
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from recursive_lightning import faults, interrupts
from recursive_lightning.errors import ArgumentParser, UserError
from recursive_lightning.files import absent
from recursive_lightning.tracking.runs import absolute_uri, sqlite_parts
from recursive_lightning.tracking.stores import CONNECT_TIMEOUT_S, check_tracking_store
from recursive_lightning.tracking.ui import (
    check_address,
    free_port,
    servable,
    start_server,
    stop_server,
    store_of,
)
from recursive_lightning.tracking.view import entry_page, experiment_links, server_links
from recursive_lightning.uris import mask_url, remember, reveal

DEFAULT_DIRS = (Path("runs") / "sweeps" / "default",)


def _served_elsewhere(uri: str, what: str) -> int:
    """A store behind its own tracking server: its experiments' ranked links on that server."""
    try:  # a server that is not there: one sentence in seconds (MLflow's client retries for minutes)
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=CONNECT_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        pass  # it answers
    except (OSError, ValueError) as e:
        raise UserError(
            f"ui: {what} does not answer ({getattr(e, 'reason', e)}); start it or pass another --tracking-uri."
        ) from None
    try:
        lines = server_links(uri)
    except Exception as e:  # unreachable: one sentence
        raise UserError(
            f"ui: {what} does not answer ({type(e).__name__}); start it or pass another --tracking-uri."
        ) from None
    print(f"{what}; open:", flush=True)
    for line in lines:
        print(line, flush=True)
    return 0


def main(argv: list[str]) -> int:
    p = ArgumentParser(
        prog="recursive_lightning ui",
        description="Serve the MLflow UI of a run or sweep directory (moved or copied ones included).",
    )
    p.add_argument("run_dir", nargs="?", help="a train or sweep --run-dir (default runs/sweeps/default)")
    p.add_argument(
        "--port", type=int, default=5000, help="port on 127.0.0.1 (default 5000, else the next free)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)"
    )
    p.add_argument("--tracking-uri", help="serve this store instead (sqlite:///..., postgresql://...)")
    args = p.parse_args(argv)
    check_address(args.host, args.port)
    if args.tracking_uri and args.tracking_uri.startswith(("http://", "https://")):
        return _served_elsewhere(
            args.tracking_uri, f"the runs are served by their tracking server {mask_url(args.tracking_uri)}"
        )
    if args.tracking_uri:
        uri = reveal(remember(absolute_uri(args.tracking_uri)))
        parts = sqlite_parts(uri)
        if parts is not None and not Path(parts[0]).is_file():  # MLflow would make an empty store there
            raise UserError(
                f"ui: --tracking-uri '{mask_url(args.tracking_uri)}': '{parts[0]}' {absent(parts[0])}; pass the "
                "mlflow.db of a run or sweep directory, or the directory itself."
            )
    else:
        run_dir = args.run_dir or next((str(d) for d in DEFAULT_DIRS if d.is_dir()), None)
        if run_dir is None:
            raise UserError(
                "ui: no run directory given and runs/sweeps/default does not exist here; pass the --run-dir of "
                "a `train` or `sweep`."
            )
        uri = store_of(run_dir)
        if uri.startswith(("http://", "https://")):
            return _served_elsewhere(uri, f"'{run_dir}' logs to the tracking server {mask_url(uri)}")
    # a database server that does not answer (mlflow server would wait on it for minutes), a driver that is not
    # installed, a damaged SQLite file: one sentence before the server starts
    check_tracking_store(uri, "--tracking-uri" if args.tracking_uri else f"of '{args.run_dir}'")
    folder = uri[len("file://") :] if uri.startswith("file://") else None
    if folder is not None and not Path(folder).is_dir():  # MLflow would make an empty store there
        raise UserError(
            f"ui: --tracking-uri '{mask_url(uri)}': '{folder}' {absent(folder)}; pass the mlflow.db of a run or "
            "sweep directory, or the directory itself."
        )

    def _stop(
        signum, frame
    ):  # SIGTERM or a closed terminal stops the server too (it runs in its own session)
        if interrupts.defer_in_hook(signum, frame):
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):  # once: a second signal must not cut the stopping short
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    with tempfile.TemporaryDirectory(prefix="rl-ui-") as tmp:
        workdir = Path(tmp)
        uri = servable(uri, workdir)
        port = free_port(args.host, args.port)
        proc = start_server(uri, args.host, port, workdir)
        base = f"http://{args.host}:{port}"
        try:  # from here on, whatever stops this command stops the server's processes too
            print(f"MLflow UI at {base}  (store {mask_url(uri)}; Ctrl-C to stop)", flush=True)
            faults.point("ui_links")
            for line in experiment_links(uri, base, entry_page(base)):
                print(line, flush=True)
            proc.wait()
        except KeyboardInterrupt:
            pass
        finally:
            stop_server(proc)
    return 0
