"""What the benchmarks record of the machine: a CPU's model name alone does not tell two hosts apart."""

from benchmarks.common import cpu_identity, machine

ZEN5 = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 26
model		: 2
model name	: AMD EPYC
flags		: fpu sse sse2 sse4_2 avx avx2 avx512f avx512bw

processor	: 1
cpu family	: 26
model		: 2
model name	: AMD EPYC
flags		: fpu sse sse2 sse4_2 avx avx2 avx512f avx512bw
"""
OLDER = ZEN5.replace("26", "25").replace("model		: 2", "model		: 17").replace(" avx512f avx512bw", "")
GRAVITON = """processor	: 0
BogoMIPS	: 243.75
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm
CPU implementer	: 0x41
"""


def test_two_cpus_of_one_model_name_are_told_apart_by_family_model_and_vector_width():
    new, old = cpu_identity(ZEN5), cpu_identity(OLDER)
    assert new == {"cpu": "AMD EPYC", "cpu_family_model": "26/2", "simd": "avx512f"}
    assert old == {"cpu": "AMD EPYC", "cpu_family_model": "25/17", "simd": "avx2"}
    assert cpu_identity(GRAVITON) == {"cpu": None, "cpu_family_model": None, "simd": "asimd"}


def test_the_machine_record_names_the_cpu_it_ran_on():
    info = machine()
    assert info["cpu"] and info["cpu_count"] >= 1
    assert {"cpu_family_model", "simd"} <= set(info)
