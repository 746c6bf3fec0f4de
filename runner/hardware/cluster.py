"""``hardware=cluster``: ranks on several hosts (Open MPI ``--host``/``--hostfile``).

It needs ssh or a resource manager between the hosts, and the same Python environment at the same path on
every host."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from runner.hardware.base import HardwareConfig
from runner.hardware.mpirun import usable_cores
from runner.hardware.topology import Placement
from runner.schema import require


@dataclass
class ClusterConfig(HardwareConfig):
    """Ranks on the hosts of ``hosts`` (``host:slots``) or of an Open MPI ``hostfile``."""

    hosts: list[str] = field(default_factory=list)
    hostfile: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            not (self.hosts and self.hostfile),
            "hosts",
            self.hosts,
            "give hardware.hosts or hardware.hostfile",
        )
        require(
            bool(self.hosts or self.hostfile),
            "hosts",
            self.hosts,
            "hardware=cluster needs hardware.hosts=[host1:slots,host2:slots] or hardware.hostfile=FILE",
        )
        require(
            all(re.fullmatch(r"[\w.-]+(:\d+)?", h) for h in self.hosts),
            "hosts",
            self.hosts,
            "each entry is host or host:slots, e.g. node1:4",
        )
        require(
            self.hostfile is None or Path(self.hostfile).is_file(),
            "hostfile",
            self.hostfile,
            "no such file; an Open MPI hostfile has lines like `node1 slots=4`",
        )

    def slots(self) -> int:
        """Slots of ``hosts`` (``host:slots``, default 1) or of the hostfile (``slots=N``)."""
        if self.hosts:
            return sum(int(h.partition(":")[2] or 1) for h in self.hosts)
        lines = self._hostfile_lines()
        return sum(int(next((w[6:] for w in ln[1:] if w.startswith("slots=")), 1)) for ln in lines)

    def cores(self) -> int:
        """The hosts' slots (this machine's cores when the hostfile gives none)."""
        return self.slots() or usable_cores()

    def where(self, cores: int) -> str:
        source = f"hardware.hosts={list(self.hosts)}" if self.hosts else f"the hostfile {self.hostfile}"
        return f"{source} {'has' if self.hostfile else 'have'} {cores} slot{'s' if cores != 1 else ''}"

    def check_fits(self, ranks: int, cores: int) -> None:
        """Refuse more ranks than the hosts' slots, as on one machine.

        A hostfile line without ``slots=`` lets mpirun count that host's cores, which the launcher cannot see,
        so such a hostfile is not checked here."""
        if self.hostfile and not self.slots_given():
            return
        super().check_fits(ranks, cores)

    def _hostfile_lines(self) -> list[list[str]]:
        """The hostfile's lines as words, without comments and empty lines."""
        lines = [ln.split("#")[0].split() for ln in Path(self.hostfile).read_text().splitlines()]
        return [ln for ln in lines if ln]

    def host_names(self) -> list[str]:
        """The names of ``hosts`` or of the hostfile's lines, in order."""
        if self.hosts:
            return [h.partition(":")[0] for h in self.hosts]
        return [ln[0] for ln in self._hostfile_lines()]

    def slots_given(self) -> bool:
        """Whether every line of the hostfile says its ``slots=``."""
        return all(any(w.startswith("slots=") for w in ln[1:]) for ln in self._hostfile_lines())

    def gpu_plan(self, ranks: int, threads: int) -> list[Placement] | None:
        """None: the launcher cannot see the other hosts; each rank takes its node-local rank's GPU."""
        return None

    @property
    def one_machine(self) -> bool:
        return False

    def host_args(self, flavor: str) -> list[str]:
        if flavor == "openmpi":
            return ["--host", ",".join(self.hosts)] if self.hosts else ["--hostfile", self.hostfile]
        return ["-hosts", ",".join(self.hosts)] if self.hosts else ["-f", self.hostfile]
