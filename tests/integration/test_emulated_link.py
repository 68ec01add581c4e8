"""The emulated link (testbed.link) on this machine's real `lo`: a transfer over the
shaped ports takes the time the rate says, a NIXL WRITE between two processes with the
servers' UCX settings goes over them (and takes the rate's time), traffic on any other
port (the router's HTTP, the ZMQ side channels) is not slowed, and the qdisc is gone
afterwards. Needs root and `tc` with htb and u32: skipped, saying which, without."""

from __future__ import annotations

import os
import shutil

import pytest

from scripts import bench_nixl
from testbed import link
from testbed.profiles import get_profile

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None,
    reason="the emulated link needs root and the `tc` tool (iproute2)")

@pytest.fixture(autouse=True)
def _link_free() -> None:
    """`lo` is the machine's: a benchmark or another test run holding the link is left
    alone (this test would replace its shaping), and the test says so."""
    current = link.holder()
    if current is not None and current != os.getpid():
        pytest.skip(f"the emulated link is held by process {current} (a benchmark or test)")


# eth25 for llama8b-h100 against the 8-layer emulated model: 390.6 Mb/s.
RATE = link.scaled_rate_bps(25.0, 2048, get_profile("llama8b-h100").kv_bytes_per_token)


def test_the_shaped_ports_take_the_rates_time_and_other_ports_do_not() -> None:
    with link.shaped(RATE) as shaper:
        assert link.installed()
        proof = link.prove(shaper, seconds=0.4)
        assert proof.ratio == pytest.approx(1.0, abs=0.1), proof.line()
        assert proof.unshaped_s * 4 < proof.shaped_s, proof.line()
        assert proof.ok(), proof.line()
        sent = link.shaped_bytes()
        assert sent is not None and proof.nbytes <= sent < proof.nbytes * 1.05
        # Re-rated live: twice the rate, half the time.
        shaper.set(RATE * 2)
        faster = link.prove(shaper, seconds=0.4)
        assert faster.ratio == pytest.approx(1.0, abs=0.1), faster.line()
    assert not link.installed()
    assert not link.clear()  # nothing left to clear
    assert link.holder() is None  # released


def test_a_second_holder_is_refused_while_the_first_lives() -> None:
    with link.shaped(RATE):
        link.HOLDER_PATH.write_text("1")  # pid 1 lives: another holder, as it were
        try:
            with pytest.raises(link.LinkError, match="in use by process 1"), link.shaped(RATE):
                pass
        finally:
            link.HOLDER_PATH.write_text(str(os.getpid()))
    assert link.holder() is None and not link.installed()


def test_a_nixl_write_with_the_servers_ucx_settings_goes_over_the_link(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in link.ucx_env().items():
        monkeypatch.setenv(key, value)  # the spawned agents inherit them
    blocks, block_bytes = 64, 65536
    params = bench_nixl.Params(device="cpu", block_bytes=block_bytes, blocks=blocks,
                               iterations=2, warmup=1, noncontiguous=False,
                               one_block_rounds=1, progress_thread=False, timeout=60)
    with link.shaped(RATE):
        result = bench_nixl.run(params)
        sent = link.shaped_bytes()
    assert result["verified"] is True
    expected_ms = blocks * block_bytes * 8 / RATE * 1e3  # 85.9 ms
    assert result["latency_ms_p50"] == pytest.approx(expected_ms, rel=0.2)
    # Every WRITE (warm-up, measured, one-block) crossed the shaped class.
    assert sent is not None and sent >= (1 + 2) * blocks * block_bytes
