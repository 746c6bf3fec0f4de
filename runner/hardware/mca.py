"""Open MPI's MCA options (``hardware.mca``): each value as Open MPI reads it, and a check before launch.

Open MPI reads an MCA value in every rank's ``MPI_Init``. A value it cannot read (``True`` for a bool,
``maybe`` for an enum) gets a box on each rank's stderr ("An invalid value was supplied for an enum
variable") and the job trains without the option; a key it does not know is ignored without a word; an
integer it cannot read becomes 0. So the config check refuses values that are no MCA value (null, a nested
map), :func:`render` writes the others as Open MPI reads them (``true``/``false``, lists comma-joined), and
before anything starts :func:`check_mca` compares every key and value with the parameters the installation
declares (``ompi_info --param all all --level 9 --parsable``, ~50 ms, once per ``ompi_info`` and process;
PRRTE's and PMIx's keys through ``prte_info`` and ``pmix_info``), raising ValueError naming
``hardware.mca.<key>``, what Open MPI accepts and the closest known names.
"""

from __future__ import annotations

import difflib
import functools
import logging
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Open MPI options every job gets unless ``hardware.mca`` sets the same key. The libfabric BTL (``ofi``)
#: probes the fabric providers inside MPI_Init, a large part of a rank's start (benchmarks/README.md).
#: Messages still travel by shared memory and TCP (on fabrics: pml ucx or mtl ofi). One-sided calls (dynamic
#: assignment's counter) leave out ``osc/ucx``, which without UCX devices prints an error at every window
#: made; on a UCX fabric give ``hardware.mca.osc=ucx`` for counters across nodes.
#: The TCP BTL without its emulated RDMA put (``btl_tcp_flags`` 57 = send, inplace, need-ack, need-csum):
#: with put, a large message waits for the receiver's control message, queued behind the data the receiver
#: sends the other way, so the two directions of a ring all-reduce took turns (8.7 MB over 100 Mbit/s
#: links: 1097-1479 ms with put, 747-870 without; benchmarks/README.md, "Emulated links against real ones").
DEFAULT_MCA = {"btl": "^ofi", "osc": "^ucx", "btl_tcp_flags": "57"}
#: The BTLs of a job on one machine that does not grow: its ranks talk over shared memory, and without TCP's
#: BTL no rank listens on the network (it listens on every address: ``btl_tcp_if_include`` picks the routes,
#: not the socket). A job that may grow keeps it: processes spawned into it reach the others only by TCP
#: (without it Open MPI reports them unreachable, help-mca-bml-r2.txt). Open MPI's runtime (PRRTE) still
#: listens on every address: it refuses a loopback-only ``prte_if_include`` ("No network interfaces were
#: found for out-of-band communications").
ONE_NODE_BTL = "^ofi,tcp"
#: The collective components of a fault-tolerant job (``--with-ft ulfm``) that sets no ``coll``: the ones
#: Open MPI's ``ft-mpi`` parameter set leaves out (hcoll, portals4), and coll/han, which ULFM does not count
#: among its tested components (basic, tuned, ftagree, libnbc). HAN, chosen for communicators that span
#: nodes, is not fault tolerant: its all-reduce over a communicator that had lost a node's ranks returned
#: success to the survivors (a sum without the lost ranks; tests/cluster/test_failures.py), spun on
#: libnbc's errors, or crashed rank 0 (a segfault in ob1's isend under libnbc's ibcast, "Error in
#: NBC_Start_round() (-1)"). Such jobs take coll/tuned's flat algorithms instead; ``hardware.hierarchical``
#: is refused under fault tolerance for the same reason.
TOLERANT_COLL = "^hcoll,portals4,han"

#: First words of the keys of PRRTE, mpirun's runtime (``prte_info``): no rank reads them.
PRRTE_PREFIXES = (
    "prte", "plm", "rmaps", "ras", "odls", "errmgr", "state", "oob", "ess", "filem", "grpcomm", "iof",
    "rml", "routed", "rtc", "schizo", "prtebacktrace", "prtedl", "prteinstalldirs", "prtereachable",
)  # fmt: skip
#: First words of PMIx's keys (``pmix_info``): read by PMIx in mpirun and in each rank (``PMIX_MCA_*``).
PMIX_PREFIXES = (
    "pmix", "bfrops", "gds", "pcompress", "pdl", "pfexec", "pif", "plog", "pmdl", "pnet", "preg", "psec",
    "psensor", "pshmem", "psquash", "pstat", "pstrg", "ptl",
)  # fmt: skip

#: How Open MPI's bool parameters read a word (case matters); any integer also reads (0: false).
BOOL_WORDS = ("true", "t", "enabled", "yes", "y", "false", "f", "disabled", "no", "n")
#: An integer as Open MPI reads one (``strtoull`` base 0, then an optional k/m/g multiplier).
INTEGER = re.compile(r"\s*[-+]?(0[xX][0-9a-fA-F]+|[0-9]+)[kKmMgG]?")
INT_TYPES = ("int", "unsigned_int", "long", "unsigned_long", "unsigned_long_long", "size_t", "int32_t")
INT_TYPES += ("uint32_t", "int64_t", "uint64_t")
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
#: The names of Open MPI's verbosity enums (``*_verbose``), which take any integer as well.
VERBOSITY = {"none", "error", "component", "warn", "info", "trace", "debug", "max"}

log = logging.getLogger("runner")


def one_node(mca: Mapping[str, Any], grows: bool) -> dict[str, Any]:
    """``hardware.mca`` for a job on this machine alone.

    The default ``btl`` is without TCP's unless the job may grow (``grows``: processes are spawned into it); a
    ``btl`` the user set is kept as given."""
    if mca.get("btl") == DEFAULT_MCA["btl"] and not grows:
        return {**mca, "btl": ONE_NODE_BTL}
    return dict(mca)


def tolerant(mca: Mapping[str, Any]) -> dict[str, Any]:
    """``hardware.mca`` for a job that may lose ranks: ``coll`` without HAN unless the user set ``coll``."""
    return dict(mca) if "coll" in mca else {**mca, "coll": TOLERANT_COLL}


def render(value: Any) -> str:
    """A ``hardware.mca`` value as Open MPI reads it: ``true``/``false``, lists comma-joined, else ``str``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(render(item) for item in value)
    return str(value)


def value_problem(key: str, value: Any) -> str | None:
    """Why ``value`` (of ``hardware.mca.<key>``) cannot be given to Open MPI; None when it can."""
    if not NAME.fullmatch(key):
        return "an MCA parameter's name is letters, digits and _ (e.g. btl_tcp_if_include)"
    if value is None:
        return f"give a value, or leave the key out (~hardware.mca.{key} on the command line)"
    if isinstance(value, Mapping):
        inner, item = next(iter(value.items()), ("NAME", "VALUE"))
        return (
            "an MCA option takes one value (a string, a number, true/false, or a list, comma-joined); "
            f"nested keys are no MCA parameters: write the whole name, e.g. +hardware.mca.{key}_{inner}="
            f"{render(item) if not isinstance(item, Mapping) else 'VALUE'}"
        )
    if isinstance(value, (list, tuple)):
        if not value:
            return f"an empty list: give its items, e.g. [tcp,self], or drop the key (~hardware.mca.{key})"
        if not all(isinstance(item, (str, int, float)) for item in value):
            return "a list's items are strings or numbers (it is passed comma-joined: [tcp,self] -> tcp,self)"
        return None
    if not isinstance(value, (str, int, float)):
        return "give a string, a number, true/false or a list"
    return None


@dataclass
class Param:
    """One MCA parameter as ``ompi_info`` declares it: its type and, for enums, the values it names."""

    type: str = "string"
    enum: dict[str, int] = field(default_factory=dict)  # lower-case name -> value

    @property
    def flags(self) -> bool:
        """Whether the enum is a set of flags (Open MPI takes them comma-joined): every value a power of 2."""
        return len(self.enum) > 1 and all(v > 0 and v & (v - 1) == 0 for v in self.enum.values())

    def accepts(self) -> str:
        """What Open MPI accepts, for messages."""
        if self.type == "bool":
            return "true or false, lower-case (or 1|0, yes|no, enabled|disabled)"
        if self.enum:
            listed = ", ".join(f"{v}|{name}" for name, v in sorted(self.enum.items(), key=lambda i: i[1]))
            if VERBOSITY <= set(self.enum):
                return f"an integer or one of: {listed}"
            more = " (or yes|no, enabled|disabled)" if {"true", "false"} <= set(self.enum) else ""
            return ("a comma-joined list of: " if self.flags else "one of: ") + listed + more
        if self.type in INT_TYPES:
            return f"an integer ({self.type}; k, m or g multiply by 1024...)"
        if self.type == "double":
            return "a number"
        return "a string"


@dataclass
class McaParams:
    """The MCA parameters and components of one Open MPI installation (its ``ompi_info``)."""

    source: str
    params: dict[str, Param]
    components: dict[str, set[str]]  # framework -> its components


def parse_ompi_info(text: str, source: str = "ompi_info") -> McaParams:
    """``ompi_info --param all all --level 9 --parsable``'s lines ``mca:FW:COMPONENT:param:NAME:ATTR:...``."""
    params: dict[str, Param] = {}
    components: dict[str, set[str]] = {}
    for line in text.splitlines():
        parts = line.split(":", 6)
        if len(parts) < 4 or parts[0] != "mca":
            continue
        if parts[2] != "base":
            components.setdefault(parts[1], set()).add(parts[2])
        if parts[3] != "param" or len(parts) < 7:
            continue
        param = params.setdefault(parts[4], Param())
        attr, rest = parts[5], parts[6]
        if attr == "type":
            param.type = rest
        elif attr == "enumerator" and rest.startswith("value:"):
            number, _, name = rest[6:].partition(":")
            param.enum[name.lower()] = int(number)
        elif attr == "synonym" and rest.startswith("name:"):
            params.setdefault(rest[5:], param)
    return McaParams(source, params, components)


@functools.cache
def ompi_params(ompi_info: str) -> McaParams | None:
    """The parameters ``ompi_info`` declares (cached per path); None when it cannot be run or lists none."""
    argv = [ompi_info, "--param", "all", "all", "--level", "9", "--parsable"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = parse_ompi_info(out, ompi_info)
    return found if found.params else None


@functools.cache
def runtime_names(info: str) -> tuple[frozenset[str], str] | None:
    """PRRTE's or PMIx's parameter names from ``prte_info -a`` / ``pmix_info -a`` (``info``).

    Returns the names, and the whole text (synonyms are listed there); None without it. Their output has no
    ``--parsable``."""
    try:
        out = subprocess.run([info, "-a"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = frozenset(re.findall(r'MCA [\w ]+: "(\w+)" \(current value', out))
    return (names, out) if names else None


def ompi_info_of(mpirun: str) -> Path | None:
    """The ``ompi_info`` of the installation of ``mpirun`` (beside it, or beside the file it links to)."""
    for folder in (Path(mpirun).parent, Path(mpirun).resolve().parent):
        if (folder / "ompi_info").is_file():
            return folder / "ompi_info"
    return None


def check_mca(mpirun: str, flavor: str, mca: Mapping[str, Any]) -> None:
    """Refuse, before launch, a ``hardware.mca`` key or value that the MPI of ``mpirun`` would ignore.

    With MPICH (no ``--mca``), keys other than the defaults are refused. With Open MPI, each key must be a
    parameter of its ``ompi_info`` (or of ``prte_info``/``pmix_info``; PRRTE's and PMIx's keys pass when
    those cannot be read) and each value one that parameter's type reads. Without an ``ompi_info`` the
    check is skipped with a warning. Raises ValueError naming ``hardware.mca.<key>``, the value and the fix.
    """
    if flavor != "openmpi":
        check_mpich(mpirun, mca)
        return
    info = ompi_info_of(mpirun)
    known = ompi_params(str(info)) if info else None
    if known is None:
        log.warning("hardware.mca is not checked: no ompi_info beside %s lists Open MPI's parameters", mpirun)
        return
    for key, value in mca.items():
        text = render(value)
        param = known.params.get(key)
        if param is None:
            check_unknown(key, text, known, info.parent)
            continue
        hint = value_hint(key, text, param, known)
        if hint:
            raise ValueError(f"hardware.mca.{key}={text!r} is invalid: {hint} (per {known.source})")


def value_hint(key: str, text: str, param: Param, known: McaParams) -> str | None:
    """Why Open MPI would not read ``text`` for ``param`` (named ``key``) as meant; None when it would."""
    if key in known.components and param.type == "string":
        return component_hint(key, text, known.components[key])
    if param.type == "bool":
        ok = text in BOOL_WORDS or re.fullmatch(r"\s*[-+]?[0-9]+", text)
        return None if ok else f"Open MPI takes {param.accepts()}"
    if param.enum:
        return enum_hint(text, param)
    if param.type in INT_TYPES and not INTEGER.fullmatch(text):
        return f"Open MPI takes {param.accepts()} and would read {text!r} as a wrong number, silently"
    if param.type == "double":
        try:
            float(text)
        except ValueError:
            return f"Open MPI takes {param.accepts()} and would read {text!r} as 0, silently"
    return None


def enum_hint(text: str, param: Param) -> str | None:
    """Why Open MPI's enum ``param`` would refuse ``text``.

    It takes a name (any case; flags comma-joined), or its number; a verbosity takes any integer, and an
    auto/true/false enum the bool words too."""
    number, names = c_integer(text), set(param.enum)
    if number is not None and (param.flags or number in param.enum.values() or VERBOSITY <= names):
        return None
    words = text.lower().split(",") if param.flags else [text.lower()]
    if all(word in names for word in words) or ({"true", "false"} <= names and words[0] in BOOL_WORDS):
        return None
    return f"Open MPI takes {param.accepts()}"


def c_integer(text: str) -> int | None:
    """``text`` read whole as C's ``strtol(text, &end, 0)`` reads it (hex 0x.., octal 0..), else None."""
    match = re.fullmatch(r"\s*([-+]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", text)
    if match is None:
        return None
    digits = match[2]
    base = 16 if digits[:2].lower() == "0x" else 8 if digits.startswith("0") else 10
    return int(match[1] + digits, base)


def component_hint(framework: str, text: str, found: set[str]) -> str | None:
    """Why a component list for ``framework`` names a component this Open MPI lacks.

    An excluding ``^`` list may name any. None when every component exists."""
    if not text or text.startswith("^"):
        return None
    missing = [name for name in text.split(",") if name not in found]
    if not missing:
        return None
    return (
        f"{framework} has no component {', '.join(missing)} here (MPI_Init would abort); its components: "
        f"{', '.join(sorted(found))} (a leading ^ excludes the listed ones instead)"
    )


def check_unknown(key: str, text: str, known: McaParams, bindir: Path) -> None:
    """Refuse ``key``, which this Open MPI does not declare, unless PRRTE or PMIx does.

    Nor is a key refused that has the prefix of one whose ``*_info`` cannot be read. The refusal gives the
    closest known names."""
    names = set(known.params)
    for tool, prefixes in (("prte_info", PRRTE_PREFIXES), ("pmix_info", PMIX_PREFIXES)):
        runtime = runtime_names(str(bindir / tool))
        if runtime is None:
            if key.split("_", 1)[0] in prefixes:
                return  # nothing to check it against: passed as given
            continue
        if key in runtime[0] or re.search(rf"\b{re.escape(key)}\b", runtime[1]):
            return
        names |= runtime[0]
    close = difflib.get_close_matches(key, sorted(names), n=3)
    hint = f"did you mean {' or '.join(close)}?" if close else "see ompi_info --param all all --level 9"
    raise ValueError(
        f"hardware.mca.{key}={text!r} is invalid: the Open MPI of {bindir} has no such MCA parameter "
        f"(ompi_info, prte_info, pmix_info) and would ignore it silently; {hint} (a parameter of a component "
        f"only the ranks' nodes can load passes unchecked as hardware.env.OMPI_MCA_{key}={text})"
    )


def check_mpich(mpirun: str, mca: Mapping[str, Any]) -> None:
    """Refuse ``hardware.mca`` keys beyond the Open MPI defaults when the MPI is MPICH, which has no MCA."""
    for key, value in mca.items():
        if DEFAULT_MCA.get(key) == render(value):
            continue  # the runner's own Open MPI defaults: nothing to say to MPICH
        raise ValueError(
            f"hardware.mca.{key}={render(value)!r} is invalid: MCA options are Open MPI's and {mpirun} is "
            "MPICH, which would drop it; MPICH reads MPIR_CVAR_* environment variables "
            f"(hardware.env.MPIR_CVAR_NAME=VALUE), or leave the key out (~hardware.mca.{key})"
        )


def mca_env(mca: Mapping[str, Any]) -> dict[str, str]:
    """``hardware.mca`` as the environment variables the ranks read when srun (no mpirun) starts them.

    ``PMIX_MCA_<key>`` for PMIx's keys, ``OMPI_MCA_<key>`` for the others; PRRTE's keys are refused, as no
    PRRTE runs under srun."""
    env = {}
    for key, value in mca.items():
        if key.split("_", 1)[0] in PRRTE_PREFIXES:
            raise ValueError(
                f"hardware.mca.{key}={render(value)!r} is invalid: {key} is a key of PRRTE, mpirun's "
                f"runtime, and srun starts the ranks without it; leave the key out (~hardware.mca.{key}), "
                "or start the ranks with mpirun (hardware.launcher=mpirun, outside a job step)"
            )
        prefix = "PMIX_MCA_" if key.split("_", 1)[0] in PMIX_PREFIXES else "OMPI_MCA_"
        env[prefix + key] = render(value)
    return env
