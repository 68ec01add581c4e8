"""The scheduler's push counts: one object, which P's half and D's half of the scheduler
each add to (its own fields), and the scheduler logs (`DualScheduler`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PushStats:
    """This engine's counts, logged every `stats_interval` when they changed. P's registry
    adds its own (matched, expired, aborted, refused) from the channel thread."""

    pull_prefills: int = 0  # P: prefills kept for a D to read
    push_prefills: int = 0  # P: prefills handed to the push registry
    probes: int = 0  # P: probes answered (blocks freed at once)
    writes_done: int = 0  # P: pushes written
    writes_failed: int = 0
    writes_by_layer: int = 0  # P: of the pushes written, those written layer by layer
    writes_by_chunk: int = 0  # P: ... those whose earlier chunks went while later computed
    blocks_written: int = 0
    write_seconds: float = 0.0  # P: summed WRITE time, registration match to completion
    registrations: int = 0  # D: pushes registered with a P
    received: int = 0  # D: pushes whose KV arrived
    pull_offers: int = 0  # P: failed WRITEs whose blocks P kept for D to read
    pulled_instead: int = 0  # D: failed pushes read from P instead
    fell_back: int = 0  # D: pushes that failed: the prompt was recomputed
    aborted: int = 0  # D: pushes ended by D's own abort (client gone)
