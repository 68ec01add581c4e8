"""An EMULATED network link for the KV transfer between P and D: NIXL's UCX data path
over TCP on the loopback, shaped by `tc` to the rate a profiled link would give.

    python -m testbed.link rates                          # every link's scaled rate
    sudo python -m testbed.link apply --link eth25 --profile llama8b-h100 --layers 8
    python -m testbed.link show
    sudo python -m testbed.link clear                      # remove it (also a leftover)

Why: in the emulated GPU regime (`testbed`, `scripts.bench_regime`) P and D are two
vLLM servers on one machine, and NIXL moves KV between them in host memory at once,
whatever the network of the GPU pair would cost. Here the transfer takes the time it
would take on the profiled link, so that transfer time over prefill time is the real
pair's.

How:
- The servers' NIXL agents use UCX over TCP on the loopback only (`ucx_env`:
  `UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`, so no shared memory or CMA copy), and UCX's TCP
  listening sockets take their ports from DATA_PORTS (`UCX_TCP_PORT_RANGE`; the range
  lies below the kernel's ephemeral ports, and `testbed.vllm_cpu.free_port` never hands
  one out). Every TCP connection of the data path has one end on such a port.
- `tc` on `lo`: an `htb` root qdisc (handle QDISC_HANDLE) whose one class is shaped to
  the link's scaled rate, and two `u32` filters sending to it the IPv4 packets whose
  source or destination port is in DATA_PORTS (one aligned block: port & PORT_MASK).
  Every other packet on `lo` (the router's and the servers' HTTP, the ZMQ side
  channels, the benchmark's client) matches no filter and leaves through htb's direct
  queue, unshaped.
- The rate: the profiled link's, times the emulated model's KV bytes per token over the
  profiled model's (`scaled_rate_bps`). The emulated model's prefill lasts the
  profile's time, its KV is far smaller (tiny model, few layers), so its KV must move
  that much slower for transfer / prefill to be the real pair's. Example: llama8b-h100
  (131,072 KV bytes per token) against the 8-layer emulated model (8 layers x K and V x
  1 KV head x 32 x 4 bytes of float32 = 2,048): eth25's 25 Gb/s becomes 390.6 Mb/s.

What it leaves out (EMULATED, not a network): RDMA's CPU offload (here the kernel's
TCP stack and UCX's TCP transport copy every byte on the machine's 2 shared cores, so
a fast link's transfer also costs host CPU that RDMA would not), congestion and other
traffic, the NIC's and the switch's latency (loopback adds microseconds, not the
few microseconds to tens of a real fabric, and no per-message RDMA setup), the
protocol overheads of RoCE/InfiniBand or Ethernet framing (the rate shapes bytes on
`lo`, TCP/IP headers counted), several NICs or rails per node, and `htb`'s own
granularity (a burst of up to BURST_S of the rate, at least two loopback packets, goes
at full speed; a transfer's time is exact to about that). Rates above what TCP on the
loopback carries on this machine are not reached: a 16 MiB NIXL WRITE unshaped took
9.6 ms (1.74 GB/s) on the 2-core machine, so `rdma400` against the 8-layer model (6.25
Gb/s: 21.5 ms for it, measured 21.7) is within a factor of about 2 of the host's own
limit, less with vLLM busy on the cores; `prove` says when the unshaped port is not at
least twice as fast.

Needs: Linux, root (CAP_NET_ADMIN), the `tc` tool (iproute2), and the kernel's `htb`
qdisc and `u32` classifier; `require_tc` says clearly what is missing. `lo` is the
machine's: one process shapes it at a time (`shaped()` refuses, naming the holder,
while another live process holds it; HOLDER_PATH). `shaped()` removes the qdisc when its
block ends, on SIGTERM and SIGINT, and at exit; `clear` removes one left behind by a
process killed outright.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICE = "lo"
# The data path's ports: 29696-29759, one block of 64 aligned to 64 (0x7400/0xffc0).
PORT_BASE = 0x7400
PORT_MASK = 0xFFC0
DATA_PORTS = range(PORT_BASE, PORT_BASE + (0x10000 - PORT_MASK))
QDISC_HANDLE = "7a26:"  # ours: `clear` removes a root qdisc with this handle only
CLASS_ID = "7a26:1"
BURST_S = 0.001  # htb bucket: this much of the rate (at least MIN_BURST_BYTES)
MIN_BURST_BYTES = 2 * 65536 + 2048  # two of the loopback's largest packets (MTU 65,536)
QUANTUM_BYTES = 65536 + 1024
EMULATED_DTYPE_BYTES = 4  # the servers run --dtype float32 (testbed.vllm_cpu)
# Who holds the link: `lo` is the machine's, so one process shapes it at a time (a
# benchmark, a test); the file names its pid. A dead holder's file is taken over.
HOLDER_PATH = Path("/tmp/testbed-link-lo.pid")


class LinkError(RuntimeError):
    """The link cannot be shaped here; the message says what is missing."""


@dataclass(frozen=True)
class Link:
    """A profiled network link: the rate one transfer gets, in Gb/s (10^9 bit/s)."""

    name: str
    gbps: float | None  # None: not shaped
    description: str


LINKS: dict[str, Link] = {link.name: link for link in (
    Link("rdma400", 400.0, "400 Gb/s RDMA (one InfiniBand NDR / RoCE 400G port)"),
    Link("eth100", 100.0, "100 Gb/s Ethernet"),
    Link("eth25", 25.0, "25 Gb/s Ethernet"),
    Link("none", None, "not shaped: TCP on the loopback at the host's speed"),
)}


def get_link(name: str) -> Link:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; known links: {', '.join(LINKS)}") from None


# The rate ------------------------------------------------------------------------------


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int = EMULATED_DTYPE_BYTES,
                       ) -> int:
    """K and V of one token in every layer of a Llama-like model's config.json:
    layers x 2 x KV heads x head_dim x bytes per element."""
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim")
                   or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    return int(config["num_hidden_layers"]) * 2 * heads * head_dim * dtype_bytes


def model_kv_bytes_per_token(model_dir: Path, dtype_bytes: int = EMULATED_DTYPE_BYTES) -> int:
    """`kv_bytes_per_token` of the model in `model_dir` (its config.json)."""
    return kv_bytes_per_token(json.loads((Path(model_dir) / "config.json").read_text()),
                              dtype_bytes)


def scaled_rate_bps(link_gbps: float, emulated_kv_bytes: int, profile_kv_bytes: int) -> float:
    """The rate, bit/s, at which the emulated model's KV moves as long as the profiled
    model's would over `link_gbps`: link x emulated KV bytes / profiled KV bytes."""
    if link_gbps <= 0 or emulated_kv_bytes <= 0 or profile_kv_bytes <= 0:
        raise ValueError("the link's rate and both KV sizes must be positive")
    return link_gbps * 1e9 * emulated_kv_bytes / profile_kv_bytes


def transfer_s(tokens: int, kv_bytes: int, rate_bps: float) -> float:
    """Seconds `tokens` tokens of `kv_bytes` each take at `rate_bps`."""
    return tokens * kv_bytes * 8 / rate_bps


# UCX -----------------------------------------------------------------------------------


def ucx_env() -> dict[str, str]:
    """The servers' environment for the shaped data path: UCX over TCP on the loopback
    only, its listening ports in DATA_PORTS (module docstring)."""
    return {
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": DEVICE,
        "UCX_TCP_PORT_RANGE": f"{DATA_PORTS.start}-{DATA_PORTS.stop - 1}",
    }


# tc ------------------------------------------------------------------------------------


def burst_bytes(rate_bps: float) -> int:
    return max(MIN_BURST_BYTES, int(rate_bps / 8 * BURST_S))


def class_args(rate_bps: float) -> list[str]:
    """htb's class parameters for `rate_bps` (rate and ceiling alike: no borrowing)."""
    rate = f"{int(round(rate_bps))}bit"
    burst = str(burst_bytes(rate_bps))
    return ["htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst,
            "quantum", str(QUANTUM_BYTES)]


def apply_commands(rate_bps: float, device: str = DEVICE) -> list[list[str]]:
    """The `tc` commands that shape DATA_PORTS' traffic on `device` to `rate_bps`: a
    fresh htb root (unclassified packets go unshaped through its direct queue), its one
    class, and a filter each for source and destination ports."""
    match = [f"{PORT_BASE}", f"0x{PORT_MASK:04x}"]
    return [
        ["tc", "qdisc", "add", "dev", device, "root", "handle", QDISC_HANDLE, "htb"],
        ["tc", "class", "add", "dev", device, "parent", QDISC_HANDLE, "classid", CLASS_ID,
         *class_args(rate_bps)],
        *(["tc", "filter", "add", "dev", device, "parent", QDISC_HANDLE, "protocol", "ip",
           "prio", str(prio), "u32", "match", "ip", field, *match, "flowid", CLASS_ID]
          for prio, field in ((1, "sport"), (2, "dport"))),
    ]


def change_command(rate_bps: float, device: str = DEVICE) -> list[str]:
    """Re-rate the shaped class live (the qdisc and its filters stay)."""
    return ["tc", "class", "change", "dev", device, "parent", QDISC_HANDLE,
            "classid", CLASS_ID, *class_args(rate_bps)]


def clear_command(device: str = DEVICE) -> list[str]:
    return ["tc", "qdisc", "del", "dev", device, "root", "handle", QDISC_HANDLE]


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=10)


def require_tc() -> None:
    """Fail with what is missing when this machine cannot shape: Linux, root, `tc`."""
    if not sys.platform.startswith("linux"):
        raise LinkError(f"the emulated link needs Linux's tc (this is {sys.platform})")
    if shutil.which("tc") is None:
        raise LinkError("the emulated link needs the `tc` tool (package iproute2) on PATH")
    if os.geteuid() != 0:
        raise LinkError("the emulated link needs root (CAP_NET_ADMIN) to run `tc` on lo: "
                        "run as root, or pass --links none for an unshaped run")


def installed(device: str = DEVICE) -> bool:
    """Whether our qdisc is on `device` (a root htb with our handle)."""
    out = _run(["tc", "qdisc", "show", "dev", device]).stdout
    return re.search(rf"qdisc htb {re.escape(QDISC_HANDLE)} root", out) is not None


def apply(rate_bps: float, device: str = DEVICE) -> None:
    """Shape DATA_PORTS on `device` to `rate_bps`; an earlier qdisc of ours is replaced.
    Raises LinkError with tc's own message when the kernel refuses (no htb or u32)."""
    require_tc()
    if installed(device):
        clear(device)
    for cmd in apply_commands(rate_bps, device):
        done = _run(cmd)
        if done.returncode != 0:
            clear(device)
            hint = ""
            if "htb" in done.stderr.lower() or "u32" in done.stderr.lower() or \
                    "no such file" in done.stderr.lower():
                hint = " (is the kernel's sch_htb / cls_u32 module available?)"
            raise LinkError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}{hint}")


def change(rate_bps: float, device: str = DEVICE) -> None:
    """Give the shaped class a new rate, live (connections stay up)."""
    done = _run(change_command(rate_bps, device))
    if done.returncode != 0:
        raise LinkError(f"`{' '.join(change_command(rate_bps, device))}` failed: "
                        f"{done.stderr.strip()}")


def clear(device: str = DEVICE) -> bool:
    """Remove our qdisc from `device` (nothing else); True if there was one. (It does
    not ask who holds the link: `shaped` does, before it shapes.)"""
    if shutil.which("tc") is None or not installed(device):
        return False
    _run(clear_command(device))
    return True


def shaped_bytes(device: str = DEVICE) -> int | None:
    """Bytes the shaped class has sent since it was made (None: not installed)."""
    out = _run(["tc", "-s", "class", "show", "dev", device, "classid", CLASS_ID]).stdout
    found = re.search(r"Sent (\d+) bytes", out)
    return int(found.group(1)) if found else None


def show(device: str = DEVICE) -> str:
    parts = []
    for what in (["qdisc"], ["class"], ["filter"]):
        parts.append(_run(["tc", "-s", *what, "show", "dev", device]).stdout.strip())
    return "\n".join(part for part in parts if part)


def holder() -> int | None:
    """The live process that holds the link (HOLDER_PATH), or None."""
    try:
        pid = int(HOLDER_PATH.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def hold() -> None:
    """Take the link for this process; LinkError naming the holder if another live
    process has it (its qdisc would be replaced or removed under it)."""
    current = holder()
    if current is not None and current != os.getpid():
        raise LinkError(f"the emulated link on {DEVICE} is in use by process {current} (a "
                        "benchmark or test); wait for it to end, or run `python -m "
                        "testbed.link clear` if that process is not using it")
    HOLDER_PATH.write_text(str(os.getpid()))


def release() -> None:
    if holder() == os.getpid():
        with contextlib.suppress(OSError):
            HOLDER_PATH.unlink()


class Shaper:
    """The link as a running benchmark holds it: `set(rate)` shapes or re-rates (and
    shapes again if the qdisc went missing), `set(None)` removes the shaping; `close()`
    removes it for good."""

    def __init__(self, device: str = DEVICE) -> None:
        self.device = device
        self.rate_bps: float | None = None

    def set(self, rate_bps: float | None) -> None:
        if rate_bps is None:
            if self.rate_bps is not None:
                clear(self.device)
            self.rate_bps = None
            return
        if self.rate_bps is None or not installed(self.device):
            apply(rate_bps, self.device)
        else:
            change(rate_bps, self.device)
        self.rate_bps = rate_bps

    def intact(self) -> bool:
        """Whether the shaping is still as set (None: nothing to check; False: something
        removed the qdisc meanwhile)."""
        return self.rate_bps is None or installed(self.device)

    def close(self) -> None:
        clear(self.device)
        self.rate_bps = None


@contextlib.contextmanager
def shaped(rate_bps: float | None = None, device: str = DEVICE) -> Iterator[Shaper]:
    """A `Shaper` for the block (shaping at `rate_bps` if given), the link held by this
    process (`hold`: LinkError if another live process holds it); its qdisc is removed
    when the block ends, on SIGTERM or SIGINT (turned into an exit that unwinds the
    block), and at interpreter exit."""
    require_tc()
    hold()
    shaper = Shaper(device)

    def close() -> None:
        shaper.close()
        release()

    atexit.register(close)
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(sig) in (signal.SIG_DFL, None):
            previous[sig] = signal.signal(sig, _exit_on_signal)
    try:
        if rate_bps is not None:
            shaper.set(rate_bps)
        yield shaper
    finally:
        close()
        atexit.unregister(close)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


# Proof: a transfer over the shaped ports takes the rate's time, others do not -----------


def timed_transfer(port: int, nbytes: int, host: str = "127.0.0.1",
                   timeout_s: float = 60.0) -> float:
    """Seconds to send `nbytes` over one TCP connection to a listener on `host:port`, from
    the connection's first byte to the receiver's last (what a link's rate governs)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1)
    listener.settimeout(timeout_s)
    result: dict[str, float] = {}

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(timeout_s)
            got = 0
            while got < nbytes:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                if got == 0:
                    result["first"] = time.perf_counter()
                got += len(chunk)
            result["last"] = time.perf_counter()
            result["bytes"] = got

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sender:
            started = time.perf_counter()
            payload = b"\0" * (1 << 20)
            left = nbytes
            while left > 0:
                sent = sender.send(payload[:min(left, len(payload))])
                left -= sent
            sender.shutdown(socket.SHUT_WR)
            thread.join(timeout_s)
    finally:
        listener.close()
    if result.get("bytes") != nbytes:
        raise LinkError(f"the test transfer on port {port} moved {result.get('bytes')} of "
                        f"{nbytes} bytes")
    return result["last"] - started


def free_data_port(host: str = "127.0.0.1") -> int:
    """A port of DATA_PORTS that is free now (the proof's listener takes it)."""
    for port in reversed(DATA_PORTS):  # from the top: UCX picks at random from the range
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise LinkError(f"no free port in {DATA_PORTS.start}-{DATA_PORTS.stop - 1}")


def free_other_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))  # an ephemeral port: never in DATA_PORTS (below them)
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Proof:
    """One check of the shaping: a transfer on a shaped port against the rate's time,
    and one on another port (unshaped traffic, as HTTP and ZMQ) against the first."""

    rate_bps: float
    nbytes: int
    expected_s: float
    shaped_s: float
    unshaped_s: float

    @property
    def ratio(self) -> float:
        """Measured over expected on the shaped port (1.0: the rate exactly)."""
        return self.shaped_s / self.expected_s

    def ok(self, tolerance: float = 0.15) -> bool:
        """Shaped within `tolerance` of the rate's time, and the other port at least
        twice as fast as the shaped one (it is not slowed; a rate near the host's own
        loopback speed cannot show more)."""
        return (abs(self.ratio - 1.0) <= tolerance
                and self.unshaped_s * 2 <= self.shaped_s)

    def line(self) -> str:
        return (f"EMULATED link check: {self.nbytes / 1e6:.1f} MB over the shaped ports at "
                f"{self.rate_bps / 1e6:.1f} Mb/s took {self.shaped_s * 1e3:.1f} ms "
                f"(the rate says {self.expected_s * 1e3:.1f} ms: x{self.ratio:.3f}); the "
                f"same bytes on an unshaped port {self.unshaped_s * 1e3:.1f} ms "
                f"({'ok' if self.ok() else 'OUT OF TOLERANCE'})")


def prove(shaper: Shaper, seconds: float = 0.5) -> Proof:
    """Move about `seconds` of the shaper's current rate over a shaped port, then the
    same bytes over an unshaped one (see `Proof`)."""
    if shaper.rate_bps is None:
        raise LinkError("the link is not shaped: nothing to prove")
    nbytes = max(4 << 20, int(shaper.rate_bps / 8 * seconds))
    expected = nbytes * 8 / shaper.rate_bps
    return Proof(rate_bps=shaper.rate_bps, nbytes=nbytes, expected_s=expected,
                 shaped_s=timed_transfer(free_data_port(), nbytes),
                 unshaped_s=timed_transfer(free_other_port(), nbytes))


# CLI -----------------------------------------------------------------------------------


def _rate_for(args: argparse.Namespace) -> tuple[float | None, str]:
    from testbed.profiles import get_profile

    link = get_link(args.link)
    if link.gbps is None:
        return None, f"{link.name}: {link.description}"
    if args.rate_mbit is not None:
        return args.rate_mbit * 1e6, f"{link.name}: {args.rate_mbit:g} Mb/s as given"
    profile = get_profile(args.profile)
    if args.model_dir is not None:
        emulated = model_kv_bytes_per_token(args.model_dir)
    else:
        from testbed import model_dir

        emulated = kv_bytes_per_token({**model_dir.shape(args.layers), "head_dim": 32})
    rate = scaled_rate_bps(link.gbps, emulated, profile.kv_bytes_per_token)
    return rate, (f"{link.name} ({link.description}) for {profile.name}: {link.gbps:g} Gb/s "
                  f"x {emulated} / {profile.kv_bytes_per_token} KV bytes per token = "
                  f"{rate / 1e6:.1f} Mb/s (EMULATED)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m testbed.link", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rate = argparse.ArgumentParser(add_help=False)
    rate.add_argument("--link", default="eth25", choices=list(LINKS),
                      help="the profiled link (default: %(default)s)")
    rate.add_argument("--profile", default="llama8b-h100",
                      help="GPU profile whose KV bytes per token the rate scales from")
    rate.add_argument("--layers", type=int, default=8,
                      help="the emulated model's layers (its KV bytes per token)")
    rate.add_argument("--model-dir", type=Path, default=None,
                      help="read the emulated model's shape from this config.json instead")
    rate.add_argument("--rate-mbit", type=float, default=None,
                      help="shape to this rate instead of the scaled one")
    p_apply = sub.add_parser("apply", parents=[rate], help="shape the data ports on lo "
                             "(stays until `clear`)")
    p_apply.add_argument("--prove", action="store_true",
                         help="then time a transfer over it and over an unshaped port")
    sub.add_parser("clear", help="remove the shaping (ours only), also one left behind")
    sub.add_parser("show", help="tc's view of lo, with counters")
    sub.add_parser("rates", parents=[rate], help="each link's scaled rate for a profile")
    sub.add_parser("env", help="the UCX environment the servers get")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "clear":
            print("removed" if clear() else "nothing to remove")
        elif args.command == "show":
            print(show() or "(nothing on lo)")
        elif args.command == "env":
            for key, value in ucx_env().items():
                print(f"{key}={value}")
        elif args.command == "rates":
            for name in LINKS:
                args.link = name
                print(_rate_for(args)[1])
        elif args.command == "apply":
            rate, text = _rate_for(args)
            print(text)
            if rate is None:
                print("removed" if clear() else "nothing to remove")
                return 0
            hold()  # refuse while a benchmark or test holds the link
            release()
            apply(rate)
            print(f"shaped: TCP ports {DATA_PORTS.start}-{DATA_PORTS.stop - 1} on {DEVICE}; "
                  "servers need the environment of `python -m testbed.link env`; "
                  "`python -m testbed.link clear` removes it")
            if args.prove:
                shaper = Shaper()
                shaper.rate_bps = rate
                print(prove(shaper).line())
    except LinkError as error:
        print(f"testbed.link: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
