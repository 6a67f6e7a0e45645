"""StepRecord: compact binary encoding with a CRC, and validation of its fields."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from zocheck_ray import CorruptRecordError, IncompleteRecordError, NonFiniteError, StepRecord


def sample(extras=()):
    return StepRecord(step=41, seed=2**63 + 5, projected_grad=-1.25e-3, lr=1e-6, eps=1e-3,
                      fingerprint=0xDEADBEEF12345678, optimizer="sparse-mezo" if extras else "zo-sgd",
                      extras=tuple(extras))


def test_round_trip_is_exact():
    record = sample((0.5, 0.25, 3.0))
    data = record.to_bytes()
    assert len(data) == record.size == 60 + 12
    assert StepRecord.from_bytes(data) == record


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=200, deadline=None)
@given(step=st.integers(0, 2**64 - 1), seed=st.integers(0, 2**64 - 1), g=finite,
       lr=st.floats(0, 1e3), eps=st.floats(1e-12, 1.0), fp=st.integers(0, 2**64 - 1),
       optimizer=st.sampled_from(["zo-sgd", "zo-adam", "sparse-mezo"]),
       extras=st.lists(st.floats(-2.0**100, 2.0**100, width=32), max_size=5))
def test_round_trip_property(step, seed, g, lr, eps, fp, optimizer, extras):
    record = StepRecord(step, seed, g, lr, eps, fp, optimizer, tuple(extras))
    assert StepRecord.from_bytes(record.to_bytes()) == record


def test_every_flipped_byte_is_rejected():
    data = bytearray(sample((1.5,)).to_bytes())
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x40
        with pytest.raises(CorruptRecordError):
            StepRecord.from_bytes(bytes(damaged))


def test_truncated_record_is_incomplete_not_corrupt():
    data = sample((1.5, 2.5)).to_bytes()
    for cut in (0, 5, 30, len(data) - 1):
        with pytest.raises(IncompleteRecordError):
            StepRecord.read_from(data[:cut], 0)


def test_a_stream_of_records_decodes_in_order():
    records = [StepRecord(i, i * 3, 0.1 * i, 1e-3, 1e-3, 7) for i in range(10)]
    buffer = b"".join(r.to_bytes() for r in records)
    out, offset = [], 0
    while offset < len(buffer):
        record, offset = StepRecord.read_from(buffer, offset)
        out.append(record)
    assert out == records


def test_trailing_bytes_are_rejected():
    with pytest.raises(CorruptRecordError, match="trailing"):
        StepRecord.from_bytes(sample().to_bytes() + b"\0")


@pytest.mark.parametrize("field", ["projected_grad", "lr", "eps"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_scalars_are_rejected_by_name(field, value):
    kwargs = dict(step=1, seed=1, projected_grad=0.5, lr=1e-3, eps=1e-3, fingerprint=1)
    kwargs[field] = value
    with pytest.raises(NonFiniteError, match=field):
        StepRecord(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(step=-1), "step"), (dict(seed=2**64), "seed"), (dict(optimizer="adam"), "optimizer"),
    (dict(eps=0.0), "eps"), (dict(lr=-1.0), "lr"), (dict(fingerprint=-3), "fingerprint"),
])
def test_invalid_fields_are_named(kwargs, match):
    base = dict(step=1, seed=1, projected_grad=0.5, lr=1e-3, eps=1e-3, fingerprint=1)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        StepRecord(**base)
