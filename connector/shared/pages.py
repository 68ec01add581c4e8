"""Whether the KV cache lies on huge pages: a CPU server's KV transfers copy it page by
page, and on 4 KiB pages they are markedly slower than on 2 MiB ones.

vLLM allocates the KV cache with torch, which asks for transparent huge pages only when
the server runs with `THP_MEM_ALLOC_ENABLE=1`. The worker logs a hint when the cache
ended up on small pages (`small_pages`), read from the kernel's `/proc/self/smaps`.
"""

from __future__ import annotations

from pathlib import Path

SMAPS = Path("/proc/self/smaps")


def small_pages(address: int, smaps: str | None = None) -> bool:
    """Whether the mapping that holds `address` has no huge pages at all. False when it
    cannot be told (no such file, no such mapping): the hint is only given when sure."""
    if smaps is None:
        try:
            smaps = SMAPS.read_text()
        except OSError:
            return False
    inside = False
    for line in smaps.splitlines():
        fields = line.split()
        if not fields:
            continue
        if ":" not in fields[0]:  # a mapping's first line: "start-end perms offset ..."
            start, _, end = fields[0].partition("-")
            inside = int(start, 16) <= address < int(end, 16)
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1]) == 0
    return False
