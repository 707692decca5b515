"""Target: limits and rates per architecture, and from a live device's properties."""

import pytest

from tecc.ir.target import ARCHS, KiB, MiB, Target, from_properties, target


def test_reference_parts_have_the_documented_limits():
    a100, h100 = target("sm_80"), target("sm_90")
    assert (a100.sm_count, a100.smem_per_sm, a100.smem_per_block_optin) == (108, 164 * KiB, 163 * KiB)
    assert (h100.sm_count, h100.smem_per_sm, h100.smem_per_block_optin) == (132, 228 * KiB, 227 * KiB)
    assert target("sm_86").max_threads_per_sm == 1536 and target("sm_89").max_blocks_per_sm == 24
    for arch in ARCHS:
        t = target(arch)
        assert t.smem_per_block == 48 * KiB and t.registers_per_sm == 65536 and t.max_registers_per_thread == 255
        assert t.max_warps_per_sm * 32 == t.max_threads_per_sm
        assert t.source


def test_fp32_lanes_per_sm_follow_from_the_peak_rate():
    assert target("sm_80").fp32_lanes_per_sm == pytest.approx(64, rel=0.01)
    assert target("sm_90").fp32_lanes_per_sm == pytest.approx(128, rel=0.01)
    assert target("sm_86").fp32_lanes_per_sm == pytest.approx(128, rel=0.01)


def test_arch_spellings_and_unknown_arch():
    assert target("sm_90a").arch == "sm_90"
    assert target("90").arch == "sm_90"
    with pytest.raises(ValueError, match="sm_75"):
        target("sm_75")
    with pytest.raises(ValueError):
        target("ampere")


def test_from_properties_takes_the_device_numbers():
    class Props:
        multiprocessor_count = 132
        clock_rate = 1_980_000            # kHz
        memory_clock_rate = 3_201_000     # kHz
        global_memory_bus_width = 6144    # bits
        l2_cache_size = 60 * MiB
        max_shared_memory_per_block_optin = 227 * KiB
        max_threads_per_multiprocessor = 2048

    t = from_properties("sm_90", Props(), name="H200")
    assert isinstance(t, Target) and t.name == "H200"
    assert t.dram_bandwidth == pytest.approx(4.92e12, rel=0.01)
    assert t.l2_bytes == 60 * MiB
    assert t.fp32_flops == pytest.approx(target("sm_90").fp32_flops, rel=0.01)


def test_summary_names_the_limits():
    text = target("sm_90").summary()
    assert "132 SMs" in text and "48 KiB" in text and "227 KiB opt-in" in text
