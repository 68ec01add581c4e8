"""Transfer ids are secrets (the capability to abandon a push, or to register for its KV):
not predictable from the request ids a client sees echoed, never repeated by a forked
process, and 128 bits long."""

from __future__ import annotations

import os
import random
import re

from proxy.protocol import new_id, new_transfer_id

_WORDS = 624  # a Mersenne Twister's state, in 32-bit outputs
_MASK = 0xFFFFFFFF


def _untemper(y: int) -> int:
    """The generator's state word behind one 32-bit output (its tempering inverted)."""
    y ^= y >> 18
    y ^= (y << 15) & 0xEFC60000
    result = y
    for _ in range(5):
        result = y ^ ((result << 7) & 0x9D2C5680)
    y = result & _MASK
    result = y
    for _ in range(2):
        result = y ^ (result >> 11)
    return result & _MASK


def _clone_from_request_ids() -> random.Random:
    """What a client can do with 156 echoed request ids of 128 bits each (624 outputs of
    32 bits): rebuild the request-id generator and predict everything it draws next."""
    words: list[int] = []
    for _ in range(_WORDS // 4):
        value = int(new_id(), 16)
        words.extend((value >> (32 * i)) & _MASK for i in range(4))  # low word first
    clone = random.Random()
    clone.setstate((3, (*(_untemper(w) for w in words), _WORDS), None))
    return clone


def test_request_ids_do_predict_the_request_id_generator() -> None:
    """The attack works: without it, the next test would prove nothing."""
    clone = _clone_from_request_ids()
    assert new_id() == f"{clone.getrandbits(128):032x}"


def test_transfer_ids_are_not_predictable_from_request_ids() -> None:
    clone = _clone_from_request_ids()
    predicted = f"{clone.getrandbits(128):032x}"
    transfer_id = new_transfer_id()
    assert transfer_id != predicted
    assert new_id() == predicted, "the transfer id drew nothing from the request ids' source"


def test_transfer_ids_are_128_bits_of_hex_and_do_not_repeat() -> None:
    ids = {new_transfer_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{32}", tid) for tid in ids)


def test_a_forked_process_draws_other_transfer_ids() -> None:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its first id, then exit at once (no test teardown)
        try:
            os.write(write, new_transfer_id().encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        theirs = os.read(read, 64).decode()
    finally:
        os.close(read)
        os.waitpid(child, 0)
    ours = new_transfer_id()
    assert re.fullmatch(r"[0-9a-f]{32}", theirs) and theirs != ours
