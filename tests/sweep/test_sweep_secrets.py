"""Database passwords stay secret: every form of URL (``user:password@``, ``?password=``, a libpq string) is
masked in what the package prints, logs and writes, and a sweep hands its URLs to its workers and their
`train` processes through the environment, never on a command line (``ps``). What is stored masked is filled
in again from the command's own options or the environment.

The last test runs the real commands against a PostgreSQL server that asks for passwords (two roles, one for
the study, one for the MLflow store, each with its own password; skipped where PostgreSQL is not installed):
the sweep is held at a named fault point while every process's command line is read, then pre-empted (the
exit-3 sentence) and finished; no output, file, MLflow param or tag, or study attribute holds a password."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ENV, ROOT, live_children, run_sweep, write_sweep

from recursive_lightning import cli, uris
from recursive_lightning.sweep import launch, servers
from recursive_lightning.uris import STORAGE_ENV, TRACKING_ENV, mask_url, reveal, without_password

SECRET = "Tr0ub4dor3xyz"
FORMS = {  # every form a database URL carries its password in, and how it is shown
    f"postgresql+psycopg://rl:{SECRET}@db.example:5432/optuna": "postgresql+psycopg://rl:***@db.example:5432/optuna",
    f"postgresql+psycopg://rl@db.example/optuna?password={SECRET}": "postgresql+psycopg://rl@db.example/optuna?password=***",
    f"postgresql+psycopg://rl@db.example/optuna?sslmode=require&password={SECRET}&application_name=x": (
        "postgresql+psycopg://rl@db.example/optuna?sslmode=require&password=***&application_name=x"
    ),
    f"postgresql+psycopg://rl@db.example/optuna?PASSWORD={SECRET}": "postgresql+psycopg://rl@db.example/optuna?PASSWORD=***",
    f"mysql+pymysql://rl@db.example/optuna?passwd={SECRET}": "mysql+pymysql://rl@db.example/optuna?passwd=***",
    f"postgresql+psycopg://:{SECRET}@db.example/optuna": "postgresql+psycopg://:***@db.example/optuna",
    f"http://user:{SECRET}@mlflow.example:5000": "http://user:***@mlflow.example:5000",
    f"host=db.example user=rl password={SECRET} dbname=optuna": "host=db.example user=rl password=*** dbname=optuna",
    f"host=db.example password='{SECRET} x' dbname=optuna": "host=db.example password=*** dbname=optuna",
}


def test_every_form_of_a_password_is_masked_and_filled_in_again_from_where_it_was_given(monkeypatch):
    for url, shown in FORMS.items():
        assert mask_url(url) == shown and SECRET not in shown
        assert mask_url(shown) == shown  # masking twice changes nothing
        assert mask_url(f"study in {url}; tracking {url}") == f"study in {shown}; tracking {shown}"
    for plain in ("sqlite:////tmp/a.db", "postgresql+psycopg://rl@db.example:5432/optuna", "http://h:5000/x"):
        assert mask_url(plain) == plain and reveal(plain) == plain
    # a masked URL read back: the one the environment gives, else without its password (PGPASSWORD, ~/.pgpass)
    query = f"postgresql+psycopg://rl@db.example/optuna?sslmode=require&password={SECRET}"
    auth = f"postgresql+psycopg://rl:{SECRET}@db.example/mlflow"
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    monkeypatch.delenv(TRACKING_ENV, raising=False)
    assert reveal(mask_url(query)) == "postgresql+psycopg://rl@db.example/optuna?sslmode=require"
    assert reveal(mask_url(auth)) == "postgresql+psycopg://rl@db.example/mlflow"
    assert without_password(mask_url(f"{query}&application_name=x#f")).endswith(
        "?sslmode=require&application_name=x#f"
    )
    monkeypatch.setenv(STORAGE_ENV, query)
    monkeypatch.setenv(TRACKING_ENV, auth)
    assert reveal(mask_url(query)) == query and reveal(mask_url(auth)) == auth
    other = "postgresql+psycopg://rl:***@elsewhere.example/mlflow"
    assert (
        reveal(other) == "postgresql+psycopg://rl@elsewhere.example/mlflow"
    )  # another server: not its password
    monkeypatch.delenv(TRACKING_ENV)
    uris.remember(auth)  # given to this command (its --tracking-uri)
    assert reveal(mask_url(auth)) == auth
    assert uris.same_server(auth, mask_url(auth))  # a password shown or masked: one server


def test_a_refusal_before_any_work_names_the_url_without_its_password(capsys, monkeypatch):
    default = str(ROOT / "ablations/default.yaml")
    for url in (
        f"postgresql+psycopg://rl@127.0.0.1:1/optuna?password={SECRET}",
        f"postgresql+psycopg://rl:{SECRET}@127.0.0.1:1/optuna",
    ):
        code = cli.main(["sweep", default, "--storage", url])
        err = capsys.readouterr().err
        assert code == 2 and mask_url(url) in err and SECRET not in err, err
        # the URL in the environment instead of on the command line (a scheduler's worker): the same
        monkeypatch.setenv(STORAGE_ENV, url)
        assert cli.main(["sweep", default, "--attach"]) == 2
        err = capsys.readouterr().err
        assert mask_url(url) in err and SECRET not in err, err
        monkeypatch.delenv(STORAGE_ENV)


def test_files_keep_urls_masked_and_commands_reading_them_fill_the_password_in(tmp_path, monkeypatch):
    from recursive_lightning.sweep.study import record_run_dir
    from recursive_lightning.tracking.runs import default_tracking_uri, record_tracking_uri
    from recursive_lightning.training.run import TrainResult

    storage = f"postgresql+psycopg://rl:{SECRET}@db.example/optuna"
    tracking = f"postgresql+psycopg://rl@db.example/mlflow?password={SECRET}"
    record_run_dir(SimpleNamespace(name="s", path=None), tmp_path, storage, tracking, "parent")
    info = json.loads((tmp_path / "sweep.json").read_text())
    assert info["storage"] == mask_url(storage) and info["tracking_uri"] == mask_url(tracking)
    record_tracking_uri(tmp_path, tracking)
    assert (tmp_path / "mlflow_tracking_uri").read_text() == mask_url(tracking)
    result = TrainResult(tmp_path, 1, 1, {}, None, None, "run", tracking, 1.0)
    assert result.to_dict()["tracking_uri"] == mask_url(tracking)
    for f in tmp_path.iterdir():
        assert SECRET not in f.read_text(), f
    monkeypatch.delenv(TRACKING_ENV, raising=False)
    assert default_tracking_uri(tmp_path) == "postgresql+psycopg://rl@db.example/mlflow"
    monkeypatch.setenv(TRACKING_ENV, tracking)  # how a sweep's worker and its `train` process are told
    assert default_tracking_uri(tmp_path) == tracking


class _Started:
    """Stands for subprocess.Popen: records the command and environment, and exits 0."""

    seen: list = []

    def __init__(self, cmd, env=None, **kw) -> None:
        _Started.seen.append((list(cmd), dict(env or os.environ)))

    def wait(self, timeout=None) -> int:
        return 0

    def poll(self) -> int:
        return 0


def test_workers_and_trial_processes_get_the_urls_through_the_environment(tmp_path, monkeypatch, tiny_run):
    from recursive_lightning.config import RunConfig
    from recursive_lightning.training.options import TrainOptions

    storage = f"postgresql+psycopg://rl:{SECRET}@db.example/optuna"
    tracking = f"postgresql+psycopg://rl@db.example/mlflow?password={SECRET}"
    monkeypatch.setattr(launch.subprocess, "Popen", _Started)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _Started.seen = []
    assert launch.spawn_workers(2, tmp_path / "s.yaml", tmp_path, storage, tracking) == 0
    trial_dir = tmp_path / "trials" / "p"
    trial_dir.mkdir(parents=True)
    (trial_dir / "result.json").write_text(
        json.dumps({"steps": 1, "tokens": 1, "metrics": {}, "mlflow_run_id": "r", "run_dir": str(trial_dir)})
    )
    cfg = RunConfig.from_dict(tiny_run())
    options = TrainOptions(
        tracking_uri=tracking, experiment="e", run_name="p", parent_run_id="parent", tags={}
    )
    launch._train_in_subprocess(cfg, trial_dir, options, ["0"])
    assert len(_Started.seen) == 3
    for cmd, env in _Started.seen:
        assert SECRET not in " ".join(cmd), cmd  # what `ps` shows
        assert env[TRACKING_ENV] == tracking
    for cmd, env in _Started.seen[:2]:  # the workers: both URLs masked on the line, whole in the environment
        assert cmd[cmd.index("--storage") + 1] == mask_url(storage) and env[STORAGE_ENV] == storage
        assert cmd[cmd.index("--tracking-uri") + 1] == mask_url(tracking)
    cmd, env = _Started.seen[2]  # the trial's `train` process
    assert cmd[cmd.index("--tracking-uri") + 1] == mask_url(tracking) and env["CUDA_VISIBLE_DEVICES"] == "0"


# --- the real commands against a PostgreSQL server that asks for passwords -------------------------------
STUDY_PW, RUNS_PW = "c0rrectHorse42", "b4tteryStaple77"


@pytest.fixture(scope="module")
def password_pg():
    """A throwaway PostgreSQL whose roles rl_study (database optuna) and rl_runs (databases mlflow and train)
    must give their passwords over TCP."""
    if servers.postgres_bindir() is None:
        pytest.skip("PostgreSQL's server binaries (initdb, pg_ctl) are not installed")
    import psycopg

    with servers.LocalPostgres(fast=True) as pg:
        admin = f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres"
        with psycopg.connect(admin, autocommit=True) as c:
            for role, pw, db in (("rl_study", STUDY_PW, "optuna"), ("rl_runs", RUNS_PW, "mlflow")):
                c.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{pw}'")
                c.execute(f"CREATE DATABASE {db} OWNER {role}")
            c.execute("CREATE DATABASE train OWNER rl_runs")
        hba = pg.data / "pg_hba.conf"
        hba.write_text("host all rl_study,rl_runs 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute("SELECT pg_reload_conf()")
        with pytest.raises(psycopg.OperationalError, match="password"):  # the passwords are really asked for
            psycopg.connect(f"host=127.0.0.1 port={pg.port} user=rl_study dbname=optuna").close()
        yield pg


def _command_lines_holding(secrets: tuple[str, ...]) -> dict[int, str]:
    """Every process whose command line (what `ps` shows) holds one of ``secrets``."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                line = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(s in line for s in secrets):
                out[int(d.name)] = line
    return out


def test_a_sweep_on_password_protected_servers_keeps_the_passwords_out_of_output_files_and_ps(
    password_pg, tmp_path, data_cache, monkeypatch
):
    import optuna
    from mlflow.tracking import MlflowClient

    port = password_pg.port
    storage = f"postgresql+psycopg://rl_study:{STUDY_PW}@127.0.0.1:{port}/optuna"
    tracking = f"postgresql+psycopg://rl_runs@127.0.0.1:{port}/mlflow?password={RUNS_PW}"
    secrets = (STUDY_PW, RUNS_PW)
    spec = write_sweep(
        tmp_path / "secret.yaml",
        data_cache,
        "secret-sweep",
        {"variant": {"mesh": {"model.topology": "mesh"}}},
    )
    run_dir = tmp_path / "run"
    args = [spec, "--run-dir", run_dir, "--storage", storage, "--tracking-uri", tracking]
    env = {**ENV, "RECURSIVE_LIGHTNING_HEARTBEAT": "1,8", "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    outputs = []

    def finish(p: subprocess.Popen) -> tuple[int, str]:
        out, _ = p.communicate(timeout=900)
        outputs.append(out)
        return p.returncode, out

    # --prepare prints the command that starts workers, its URL masked
    code, out = finish(run_sweep([*args, "--prepare"], env=env))
    assert code == 0 and f"--storage {mask_url(storage)}" in out and STORAGE_ENV in out, out

    # two workers, one held inside its trial after its first checkpoint: no process but the command the user
    # typed shows a password on its command line
    mark = tmp_path / "held"
    held = {
        **env,
        "RECURSIVE_LIGHTNING_FAULT": "mid_training:1:pause",
        "RECURSIVE_LIGHTNING_FAULT_MARK": str(mark),
    }
    sweep = run_sweep([*args, "--workers", 2], env=held)
    try:
        while not mark.exists() or not mark.read_text():
            assert sweep.poll() is None, finish(sweep)[1]
            try:
                sweep.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        worker = int(mark.read_text())
        shown = {p: line for p, line in _command_lines_holding(secrets).items() if str(tmp_path) in line}
        assert set(shown) == {sweep.pid}, shown
        line = (Path(f"/proc/{worker}/cmdline").read_bytes().replace(b"\0", b" ")).decode()
        assert f"--storage {mask_url(storage)}" in line and f"--tracking-uri {mask_url(tracking)}" in line, (
            line
        )
        # the other worker, with no trial to run, leaves once it has seen this trial's heartbeat advance: until
        # then it would take over a trial put back to WAITING, and train it into the same pause
        while live_children(sweep.pid) != {worker}:
            assert sweep.poll() is None, finish(sweep)[1]
            try:
                sweep.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        # pre-empted: the sweep is not finished (exit 3) and says how to go on
        os.kill(worker, signal.SIGTERM)
        code, out = finish(sweep)
        assert code == 3 and "not finished" in out and f"--storage {mask_url(storage)}" in out, out
    finally:
        if sweep.poll() is None:  # a failed check: no sweep left behind (its workers die with it)
            sweep.kill()
            sweep.wait()

    # the same command finishes it (its trial resumes from its checkpoint)
    code, out = finish(run_sweep([*args, "--workers", 2], env=env))
    assert code == 0, out
    assert f"study in {mask_url(storage)}; tracking {mask_url(tracking)}" in out
    for out in outputs:
        assert not any(s in out for s in secrets), out

    # no file of the sweep holds a password; sweep.json and the trial's records hold the masked URLs
    for f in run_dir.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert not any(s.encode() in data for s in secrets), f
    info = json.loads((run_dir / "sweep.json").read_text())
    assert info["storage"] == mask_url(storage) and info["tracking_uri"] == mask_url(tracking)
    (trial,) = (run_dir / "trials").iterdir()
    assert json.loads((trial / "result.json").read_text())["tracking_uri"] == mask_url(tracking)

    # nor any MLflow param or tag, nor the study's attributes
    c = MlflowClient(tracking)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    assert len(runs) == 2
    for r in runs:
        text = json.dumps([r.data.params, r.data.tags])
        assert not any(s in text for s in secrets), text
    (parent,) = [r for r in runs if r.data.tags.get("kind") == "sweep"]
    assert parent.info.status == "FINISHED" and parent.data.params["sweep.storage"] == mask_url(storage)
    study = optuna.load_study(study_name="secret-sweep", storage=storage)
    trials = study.get_trials()
    attrs = json.dumps(
        [study.user_attrs, study._storage.get_study_system_attrs(study._study_id)]
        + [[t.user_attrs, t.system_attrs] for t in trials],
        default=str,
    )
    assert not any(s in attrs for s in secrets) and study.user_attrs["tracking_uri"] == mask_url(tracking)

    # `report` reads the masked URLs of sweep.json: the passwords come from the environment, and without them
    # the refusal says where to give them
    from recursive_lightning.commands import report
    from recursive_lightning.errors import ConfigError

    monkeypatch.setattr(uris, "_given", set())
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    monkeypatch.delenv(TRACKING_ENV, raising=False)
    with pytest.raises(ConfigError, match="PGPASSWORD") as e:
        report.main(["--run-dir", str(run_dir), "--no-mlflow"])
    assert not any(s in str(e.value) for s in secrets)
    monkeypatch.setenv(STORAGE_ENV, storage)
    monkeypatch.setenv(TRACKING_ENV, tracking)
    assert report.main(["--run-dir", str(run_dir)]) == 0
    assert "mesh" in (run_dir / "report.md").read_text()


def test_a_train_run_records_its_store_masked_and_resumes_with_the_password_from_the_environment(
    password_pg, tmp_path, tiny_run
):
    import yaml

    tracking = f"postgresql+psycopg://rl_runs:{RUNS_PW}@127.0.0.1:{password_pg.port}/train"
    raw = tiny_run()
    raw["train"]["max_steps"] = 4
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    env = {**ENV, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}

    def train(*args, **extra) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "recursive_lightning",
            "train",
            "--run-dir",
            str(run_dir),
            *map(str, args),
        ]
        return subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=600)

    first = train("--config", cfg, "--tracking-uri", tracking)
    assert first.returncode == 0 and RUNS_PW not in first.stdout + first.stderr, first.stdout + first.stderr
    for f in run_dir.rglob("*"):
        assert not f.is_file() or RUNS_PW.encode() not in f.read_bytes(), f
    assert (run_dir / "mlflow_tracking_uri").read_text() == mask_url(tracking)
    assert json.loads((run_dir / "result.json").read_text())["tracking_uri"] == mask_url(tracking)
    # resumed without the password: one sentence saying where to give it, before any training
    refused = train("--resume", "--max-steps", 6)
    err = refused.stderr.strip()
    assert refused.returncode == 2 and "\n" not in err and RUNS_PW not in err, err
    assert "rl_runs@127.0.0.1" in err and TRACKING_ENV in err and "PGPASSWORD" in err, err
    # with it in the environment (how a sweep's worker passes it on): the same MLflow run continues
    resumed = train("--resume", "--max-steps", 6, **{TRACKING_ENV: tracking})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 6
