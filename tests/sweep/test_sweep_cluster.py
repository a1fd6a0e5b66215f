"""A cluster sweep that finishes or says why: take-over of a dead worker's trial that never
sent a heartbeat, `--attach` checks of the run directory (a refused command leaves nothing on disk), masked
database passwords, one metric point per step after a resume, loopback tracking URIs as one server. Kills
happen at named fault points, never by timing."""

import base64
import contextlib
import http.server
import threading
import urllib.parse
from pathlib import Path

import optuna
import pytest
from conftest import ENV, ROOT, sweep_output
from mlflow.tracking import MlflowClient
from test_sweep_grow import grow_spec, parent_and_children

from recursive_lightning import cli
from recursive_lightning.commands import sweep as sweep_command
from recursive_lightning.errors import ConfigError
from recursive_lightning.sweep import servers
from recursive_lightning.tracking.runs import param_value
from recursive_lightning.uris import mask_url, same_server


def test_passwords_are_masked_and_loopback_names_are_one_server(capsys):
    url = "postgresql+psycopg://rl:S3cr3t@127.0.0.1:5432/optuna"
    assert mask_url(url) == "postgresql+psycopg://rl:***@127.0.0.1:5432/optuna"
    assert mask_url(f"run: sweep x --storage {url} --tracking-uri http://u:tok@h:5000") == (
        "run: sweep x --storage postgresql+psycopg://rl:***@127.0.0.1:5432/optuna --tracking-uri http://u:***@h:5000"
    )
    assert mask_url("sqlite:////tmp/a.db") == "sqlite:////tmp/a.db"
    assert "S3cr3t" not in param_value(url)  # MLflow params and tags pass through it (tracking.set_tags too)
    # a database that does not answer: the one-sentence error names the URL without its password
    code = cli.main(
        ["sweep", str(ROOT / "ablations/default.yaml"), "--attach", "--storage", url.replace("5432", "1")]
    )
    err = capsys.readouterr().err
    assert code == 2 and "rl:***@127.0.0.1" in err and "S3cr3t" not in err, err
    assert same_server("http://localhost:5000", "http://127.0.0.1:5000/")
    assert not same_server("http://localhost:5000", "http://127.0.0.1:5001")


def test_attach_checks_the_run_directory_and_a_refusal_leaves_nothing(tmp_path, data_cache):
    """`--attach` into a directory that is not the study's (empty: an unshared mount; another sweep's) is
    refused in one sentence before any work; so is a study file that does not exist, which is not created.
    The study's own directory, and a study whose tracking URI names the same loopback server, are fine."""
    run_dir = tmp_path / "run"
    spec = grow_spec(tmp_path, data_cache)
    assert sweep_command.main([str(spec), "--run-dir", str(run_dir), "--prepare"]) == 0
    storage = f"sqlite:///{run_dir / 'optuna.db'}"
    (tmp_path / "o").mkdir()
    other = grow_spec(tmp_path / "o", data_cache, name="other-sweep")
    assert sweep_command.main([str(other), "--run-dir", str(tmp_path / "other"), "--prepare"]) == 0

    empty = tmp_path / "not-mounted"
    with pytest.raises(ConfigError, match="does not hold the sweep 'grow-sweep' .*no sweep.json"):
        sweep_command.main([str(spec), "--attach", "--storage", storage, "--run-dir", str(empty)])
    assert not empty.exists()
    with pytest.raises(ConfigError, match="holds another sweep \\('other-sweep'"):
        sweep_command.main(
            [str(spec), "--attach", "--storage", storage, "--run-dir", str(tmp_path / "other")]
        )
    nowhere = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match="no study named 'grow-sweep'"):
        sweep_command.main([str(spec), "--attach", "--storage", f"sqlite:///{nowhere / 'optuna.db'}"])
    with pytest.raises(ConfigError, match="no study named 'grow-sweep'"):
        sweep_command.main([str(spec), "--attach", "--run-dir", str(nowhere)])
    assert not nowhere.exists() and not (Path.cwd() / "runs" / "sweeps" / "grow-sweep").exists()

    study = optuna.load_study(study_name="grow-sweep", storage=storage)
    study.set_user_attr("tracking_uri", "http://127.0.0.1:5000")
    assert servers.recorded_study(storage, "grow-sweep", "http://localhost:5000/")["tracking_uri"]
    with pytest.raises(ConfigError, match="is not the tracking store"):
        servers.recorded_study(storage, "grow-sweep", "http://localhost:5001")


def test_a_resumed_run_logs_each_step_once(tmp_path, tiny_run):
    """A run trained to step 12, its checkpoints after step 8 then lost (as when it is killed after logging
    steps 9-12 but before its next checkpoint): resumed from step 8 it retrains 9-12, and its MLflow history
    still holds one point per step of each metric, not two for the retrained ones."""
    from recursive_lightning.config import RunConfig
    from recursive_lightning.training.run import train

    cfg, run_dir = RunConfig.from_dict(tiny_run()), tmp_path / "run"
    first = train(cfg, run_dir)
    ckpts = run_dir / "checkpoints"
    for late in [ckpts / "last.ckpt", *ckpts.glob("step=000012*")]:
        late.unlink()
    again = train(cfg, run_dir, resume=True)
    assert again.mlflow_run_id == first.mlflow_run_id and again.steps == 12
    c = MlflowClient(first.tracking_uri)
    for key in ("train/loss", "val/heldout/loss"):
        steps = [m.step for m in c.get_metric_history(first.mlflow_run_id, key)]
        assert len(steps) == len(set(steps)) and max(steps) >= 11, (key, sorted(steps))


def test_the_last_worker_takes_over_a_trial_that_never_sent_a_heartbeat(pg, tmp_path, data_cache):
    """Worker A (on another node) claims the only grid point and is SIGKILLed before its first heartbeat (the
    named point `after_claim`): Optuna never calls such a trial stale. Worker B, started after, finds nothing
    waiting; it
    watches the trial for the grace period, takes it over and finishes the sweep (before: B exited 0 at once,
    the trial left RUNNING for ever)."""
    storage, run_dir = pg.create_database("lastworker"), tmp_path / "run"
    spec = grow_spec(tmp_path, data_cache, name="pg-last")
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (
        sweep_command.main(
            [
                str(spec),
                "--run-dir",
                str(run_dir),
                "--storage",
                storage,
                "--tracking-uri",
                tracking,
                "--prepare",
            ]
        )
        == 0
    )
    env = {**ENV, "RECURSIVE_LIGHTNING_HEARTBEAT": "1,4"}
    code, out = sweep_output(
        spec, "--attach", "--storage", storage, env={**env, "RECURSIVE_LIGHTNING_FAULT": "after_claim"}
    )
    assert code == -9, out
    study = optuna.load_study(study_name="pg-last", storage=storage)
    (dead,) = study.get_trials()
    assert dead.state.name == "RUNNING"
    # worker A ran on another node: B cannot see its pid die (on one machine a dead pid is requeued at once)
    study._storage.set_trial_system_attr(dead._trial_id, "host", "another-node")
    code, out = sweep_output(spec, "--attach", "--storage", storage, env=env)
    assert code == 0, out
    assert "sent no recent heartbeat" in out
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"]
    parent, (child,) = parent_and_children(tracking, "pg-last")
    assert parent.info.status == "FINISHED" and child.info.status == "FINISHED"


def test_another_run_dir_for_an_existing_study_is_refused_naming_the_studys(tmp_path, data_cache):
    """A study in a database of its own (a SQLite file outside the sweep directory here; a PostgreSQL study
    alike) runs in one directory: the same sweep given another --run-dir is refused in one sentence naming the
    study's directory (exit 2), creates nothing there and leaves the study as it was; its own directory goes on."""
    spec = grow_spec(tmp_path, data_cache)
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    code, out = sweep_output(spec, "--run-dir", run_dir, "--storage", storage, "--prepare")
    assert code == 0, out
    code, out = sweep_output(spec, "--run-dir", elsewhere, "--storage", storage, "--prepare")
    assert code == 2 and "Traceback" not in out, out
    (line,) = [line for line in out.splitlines() if line.startswith("error:")]
    assert line == (
        f"error: --run-dir '{elsewhere}': the study 'grow-sweep' in {storage} runs in '{run_dir}'; pass "
        f"--run-dir {run_dir} to continue it there, or give the sweep file a new `name:` to start another study."
    )
    assert not elsewhere.exists()
    assert optuna.load_study(study_name="grow-sweep", storage=storage).user_attrs["run_dir"] == str(run_dir)
    code, out = sweep_output(spec, "--run-dir", run_dir, "--storage", storage, "--prepare")
    assert code == 0, out


@contextlib.contextmanager
def stand_in_server(answer):
    """A local HTTP server standing in for an MLflow tracking server: ``answer(headers)`` gives each POST's
    (status, content type, body). Yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            status, kind, body = answer(self.headers)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


def test_a_tracking_server_that_does_not_allow_the_host_name_is_named_so(tmp_path, capsys):
    """MLflow's allowed-hosts check answers HTTP 403 "Invalid Host header" to a host name it does not allow
    (a cluster node's): the sentence names that check and `--allowed-hosts`, not credentials; nothing is
    written."""
    # what MLflow's HostValidationMiddleware sends
    refusal = (403, "text/plain", b"Invalid Host header - possible DNS rebinding attack detected")
    run_dir = tmp_path / "run"
    with stand_in_server(lambda headers: refusal) as port:
        argv = ["sweep", str(ROOT / "ablations/default.yaml"), "--run-dir", str(run_dir)]
        code = cli.main([*argv, "--tracking-uri", f"http://127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"does not allow the host name '127.0.0.1:{port}' (its --allowed-hosts)" in err
    assert "MLFLOW_TRACKING_PASSWORD" not in err and not run_dir.exists()


def test_a_tracking_url_with_user_and_password_reaches_its_server_with_them():
    """``http://user:password@host`` (MLflow's own client sends the pair as basic auth): the check before any
    work sends them as the same header instead of resolving ``user:password@host`` as a host name; without
    them the server's 401 names the credentials, and no sentence shows the password."""
    from recursive_lightning.tracking.stores import check_tracking_server

    want = "Basic " + base64.b64encode(b"bob:p@ss w").decode()
    seen = []

    def answer(headers):
        seen.append(headers.get("Authorization"))
        if seen[-1] == want:
            return 200, "application/json", b'{"experiments": []}'
        return 401, "application/json", b'{"error_code": "UNAUTHENTICATED"}'

    with stand_in_server(answer) as port:
        check_tracking_server(f"http://bob:{urllib.parse.quote('p@ss w')}@127.0.0.1:{port}")
        assert seen == [want]
        with pytest.raises(ConfigError, match="answered HTTP 401") as e:
            check_tracking_server(f"http://bob:wrong@127.0.0.1:{port}")
        assert "wrong" not in str(e.value) and "MLFLOW_TRACKING_USERNAME" in str(e.value)
