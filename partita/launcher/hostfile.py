"""DeepSpeed-format hostfiles (``worker-1 slots=4``), so existing cluster files keep working.

Unlike DeepSpeed we do not ssh into the hosts: ``partita run --hostfile FILE`` is started
on every host (by pdsh, a job scheduler or by hand) and each copy finds its own node rank
by looking up its hostname in the file. torchrun then does the rendezvous.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostSlots", "HostfileLayout", "hostfile_layout", "parse_hostfile", "read_hostfile"]

_LINE = re.compile(r"(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)")
_LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class HostSlots:
    host: str
    slots: int


@dataclass(frozen=True)
class HostfileLayout:
    """What a hostfile means for this node."""

    nnodes: int
    nproc_per_node: int
    master_addr: str
    node_rank: int


def parse_hostfile(text: str, *, source: str = "hostfile") -> list[HostSlots]:
    """Parse ``host slots=N`` lines; ``#`` starts a comment, blank lines are skipped.

    Raises ValueError with the line number for anything else, and for a host listed twice
    (which would make two nodes claim the same node rank).
    """
    hosts: list[HostSlots] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise ValueError(
                f"{source}:{number}: {raw.strip()!r} is not 'HOST slots=N' (e.g. 'worker-1 slots=8')"
            )
        host, slots_text = match.group("host"), match.group("slots")
        if not slots_text.isdigit() or int(slots_text) < 1:
            raise ValueError(f"{source}:{number}: slots={slots_text!r} must be a positive integer")
        if host in seen:
            raise ValueError(f"{source}:{number}: host {host!r} is already listed on line {seen[host]}")
        seen[host] = number
        hosts.append(HostSlots(host, int(slots_text)))
    if not hosts:
        raise ValueError(f"{source} lists no hosts; add lines like 'worker-1 slots=8'")
    return hosts


def read_hostfile(path: str | os.PathLike) -> list[HostSlots]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"hostfile {str(file)!r} does not exist or is not a file")
    return parse_hostfile(file.read_text(), source=str(file))


def _names_of_this_host() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn()}
    return names | {name.split(".", 1)[0] for name in names if name}


def hostfile_layout(
    hosts: list[HostSlots], *, this_host: set[str] | None = None, node_rank: int | None = None
) -> HostfileLayout:
    """Node count, processes per node, master and this node's rank from a parsed hostfile.

    ``this_host`` is the set of names this machine answers to (hostname, FQDN, short
    names; defaults to the real ones). ``node_rank`` skips the lookup, for hostfiles that
    list IP addresses. torchrun runs the same number of processes on every node, so unequal
    slots are an error rather than silently using the smallest.
    """
    slots = {h.slots for h in hosts}
    if len(slots) != 1:
        listing = ", ".join(f"{h.host}={h.slots}" for h in hosts)
        raise ValueError(
            f"hostfile slots differ between hosts ({listing}); torchrun starts the same number of "
            "processes on every node, so give every host the same slots"
        )
    if node_rank is None:
        names = _names_of_this_host() if this_host is None else set(this_host)
        matches = [i for i, h in enumerate(hosts)
                   if h.host in names or h.host.split(".", 1)[0] in names
                   or (h.host in _LOCAL_NAMES and len(hosts) == 1)]
        if not matches:
            raise ValueError(
                f"this machine ({', '.join(sorted(names))}) is not in the hostfile "
                f"({', '.join(h.host for h in hosts)}); run on a listed host or pass --node-rank"
            )
        node_rank = matches[0]
    elif not 0 <= node_rank < len(hosts):
        raise ValueError(f"--node-rank {node_rank} must be in [0, {len(hosts)}) for this hostfile")
    return HostfileLayout(nnodes=len(hosts), nproc_per_node=slots.pop(),
                          master_addr=hosts[0].host, node_rank=node_rank)
