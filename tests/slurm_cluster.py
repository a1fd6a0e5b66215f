"""A real single-node SLURM cluster for the tests: ``munged`` with a throwaway key, ``slurmctld`` and ``slurmd``
with a generated ``slurm.conf``, all in one temporary folder on loopback ports (the distribution's
``slurm-wlm`` and ``munge``; root only, as ``slurmd`` needs it to start jobs as their user).

No accounting (``sacct`` is not there; ``scontrol show job`` is), ``proctrack/linuxproc`` and ``task/none``
(no cgroups in a container), ``select/cons_tres`` as on GPU clusters, ``JobRequeue=0`` (only jobs asking ``--requeue`` are requeued). The clients
(``sbatch``, ``scontrol``, ``squeue``, ``srun``) find it through ``SLURM_CONF`` in :attr:`SlurmCluster.env`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SBIN = Path("/usr/sbin")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "srun", "sinfo", "munge")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable() -> str | None:
    """Why a cluster cannot be started here (one line), or None."""
    if os.geteuid() != 0:
        return "SLURM's slurmd must run as root to start jobs; run the tests as root"
    missing = [d for d in DAEMONS if not (SBIN / d).is_file()] + [c for c in CLIENTS if not shutil.which(c)]
    if missing:
        return f"slurm-wlm / munge are not installed (missing {', '.join(missing)})"
    return None


class SlurmCluster:
    """``with SlurmCluster() as c:`` a partition ``debug`` of one node (``cpus`` CPUs) ready for ``sbatch``."""

    def __init__(self, cpus: int = 4, gpus: int = 0, kill_wait: int = 60) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rl-slurm-"))
        self.root.chmod(0o755)  # job steps run as root but read the spool; munged wants a searchable path
        self.node = socket.gethostname().split(".")[0]
        self.cpus, self.gpus, self.kill_wait = cpus, gpus, kill_wait
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(mode=0o755, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (r / "plugstack.conf").write_text("")
        # ``gpus`` stand-in GPUs (empty files for device files; SLURM drops file-less GPUs): --gpus-per-node is
        # accepted and counted as on a GPU node (no CUDA_VISIBLE_DEVICES: they are no devices)
        for i in range(self.gpus):
            (r / f"nvidia{i}").touch()
        files = f"{r}/nvidia[0-{self.gpus - 1}]" if self.gpus > 1 else f"{r}/nvidia0"
        (r / "gres.conf").write_text(f"Name=gpu File={files}\n" if self.gpus else "")
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=rltest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.socket}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    f"PlugStackConfig={r / 'plugstack.conf'}",
                    "MailProg=/bin/true",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/builtin",
                    "MpiDefault=none",
                    "GresTypes=gpu",
                    "SwitchType=switch/none",
                    "JobRequeue=0",  # as many sites: only jobs submitted with --requeue are requeued
                    f"KillWait={self.kill_wait}",
                    "MinJobAge=3600",  # finished jobs stay visible to `scontrol show job` (no accounting)
                    "ReturnToService=2",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "JobCompType=jobcomp/none",
                    "SlurmdParameters=config_overrides",  # the node's CPUs as configured here, not the host's
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000{gres} State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")  # noqa: SIM115 (closed with the process)
        self.procs[name] = subprocess.Popen(
            [str(SBIN / name), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.root,
            start_new_session=True,
        )
        log.close()

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        self._write_conf()
        m = self.root / "munge"
        self._spawn("munged", "-F", "-f", f"--socket={self.socket}", f"--key-file={m / 'munge.key'}",
                    f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}",
                    f"--log-file={m / 'munged.log'}")  # fmt: skip
        self._wait(lambda: self.socket.exists(), timeout, "munged")
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-f", str(self.conf))
        self._wait(self._node_idle, timeout, "slurmctld / slurmd")
        return self

    def _node_idle(self) -> bool:
        p = self.run("sinfo", "-h", "-n", self.node, "-o", "%t", check=False)
        return p.returncode == 0 and p.stdout.strip() == "idle"

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "; ".join(
                    f"{f.name}: {f.read_text()[-600:]}" for f in sorted((self.root / "log").glob("*.out"))
                )
                self.stop()
                raise RuntimeError(f"{what} did not start ({', '.join(dead) or 'timeout'}): {logs}")
            time.sleep(0.2)

    def run(
        self, *cmd: str, check: bool = True, env: dict | None = None, cwd=None
    ) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster (``env``: the submitter's environment, with SLURM_CONF)."""
        p = subprocess.run(cmd, env={**(env or self.env), "SLURM_CONF": str(self.conf)}, cwd=cwd,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        if check and p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
        return p

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (the last value of each key; an array task is ``JOB_TASK``)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        fields: dict[str, str] = {}
        for line in out.splitlines():
            for word in line.split():
                k, _, v = word.partition("=")
                fields[k] = v
        return fields

    def jobs(self) -> list[str]:
        """The ids of the jobs not ended yet (pending, running, completing)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def wait_ended(self, job_id: str, timeout: float = 600.0) -> dict[str, str]:
        """Wait (polling the controller) until the job ``job_id`` has ended; returns its fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in (
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
            ):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} did not end: {fields.get('JobState')} ({fields.get('Reason')})"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (their pids checked gone)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.run("scancel", "--full", "-s", "KILL", "-u", "root", check=False)
                deadline = time.monotonic() + 30
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._kill_leftovers()
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """SIGKILL what still runs of the cluster when a job did not end before the daemons stopped: a
        ``slurmstepd`` (it outlives slurmd by design; it runs in the cluster's folder) and the job's processes
        (their environment names this cluster's SLURM_CONF)."""
        root, conf = str(self.root), f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cwd = os.readlink(proc / "cwd").removesuffix(" (deleted)")
                ours = (
                    cwd == root
                    or cwd.startswith(root + "/")
                    or conf in (proc / "environ").read_bytes().split(b"\0")
                )
            except OSError:
                continue
            if ours:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
