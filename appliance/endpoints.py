"""HOST:PORT addresses of RPC workers (`appliance serve --rpc`, `appliance worker`), parsed without
loading llama.cpp, so that config can check them (issue 52)."""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """`HOST:PORT,HOST:PORT` into endpoints; ValueError with the bad one. IPv4 addresses and names
    only: llama.cpp's RPC client splits at the first colon and resolves with gethostbyname."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rpc: {item!r} is not HOST:PORT")
        if ":" in host or "[" in host:
            raise ValueError(f"--rpc: {item!r}: llama.cpp's RPC backend speaks IPv4 only")
        out.append(Endpoint(host, int(port)))
    if len(set(out)) != len(out):
        raise ValueError("--rpc: a worker is named twice")
    return tuple(out)


def parse_split(text: str) -> tuple[float, ...]:
    """`--tensor-split 3,1`: each GPU's share of the layers, non-negative, not all zero."""
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--tensor-split: {text!r} is not a list of numbers such as 3,1") from None
    if any(not x >= 0 or x == float("inf") for x in out) or not sum(out) > 0:
        raise ValueError(f"--tensor-split {text}: shares must be non-negative and not all zero")
    return out


def is_ipv4(host: str) -> bool:
    """A dotted IPv4 address: all llama.cpp's RPC server binds (inet_addr; no names)."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback one (an unresolvable name is not)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)
