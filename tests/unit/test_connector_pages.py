"""Telling from /proc/self/smaps whether the KV cache lies on huge pages."""

from __future__ import annotations

import ctypes
import mmap

from connector.shared.pages import small_pages

SMAPS = """\
7f0000000000-7f0040000000 rw-p 00000000 00:00 0
Size:            1048576 kB
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac
7f1000000000-7f1040000000 rw-p 00000000 00:00 0
Size:            1048576 kB
AnonHugePages:   1046528 kB
VmFlags: rd wr mr mw me ac hg
"""


def test_a_mapping_without_huge_pages_is_small() -> None:
    assert small_pages(0x7F0000001000, SMAPS)


def test_a_mapping_with_huge_pages_is_not() -> None:
    assert not small_pages(0x7F1000001000, SMAPS)


def test_an_address_in_no_mapping_is_not_called_small() -> None:
    assert not small_pages(0x1000, SMAPS)
    assert not small_pages(0x7F0040000000, SMAPS)  # the end is outside


def test_this_process_s_own_maps_are_read() -> None:
    # One page of anonymous memory cannot hold a huge page.
    with mmap.mmap(-1, mmap.PAGESIZE) as page:
        page[0] = 1  # touched, so the kernel has counted it
        cell = ctypes.c_char.from_buffer(page)
        try:
            assert small_pages(ctypes.addressof(cell))
        finally:
            del cell  # the mmap cannot close while a view of it lives
