"""Random and truncated bytes never crash a message decoder: every bus message, whatever arrives,
decodes or raises the typed BadMessage (a sent ErrorReply raises its own typed error), so a service's
handler answers with an error and drops it (llmesh.wire.bus) instead of dying or holding a request."""

from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmesh.wire.errors import BadMessage, MeshError
from llmesh.wire.messages import _TYPES, SCHEMA_VERSION, ErrorReply, Message, decode, decode_any, encode, split_batch

MESSAGE_TYPES = sorted(_TYPES)
# what msgpack can carry, nested
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


def frame(header: object, blob: bytes = b"") -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return len(packed).to_bytes(4, "big") + packed + blob


def decodes_or_is_refused(data: bytes) -> Message | None:
    try:
        return decode_any(data)[0]
    except BadMessage:
        return None
    except MeshError:  # an ErrorReply: the sender's typed error, raised as such
        return None


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_decode_or_are_a_bad_message(data):
    decodes_or_is_refused(data)  # any other exception fails the test


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(MESSAGE_TYPES),
    st.dictionaries(st.text(max_size=15), VALUES, max_size=8),
    st.integers(-1, 3),
    st.binary(max_size=16),
)
def test_any_fields_under_any_type_name_decode_to_that_type_or_are_a_bad_message(type_name, fields, version, blob):
    data = frame({"v": SCHEMA_VERSION if version == 0 else version, "t": type_name, "d": fields}, blob)
    msg = decodes_or_is_refused(data)
    assert msg is None or (type(msg).__name__ == type_name and type_name != ErrorReply.__name__)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(MESSAGE_TYPES), st.data())
def test_a_message_cut_anywhere_in_its_header_is_a_bad_message(type_name, data):
    cls = _TYPES[type_name]
    # a valid instance where the type has no required fields; otherwise a header of the right shape
    try:
        whole = encode(cls())
    except Exception:  # noqa: BLE001 - required fields
        whole = frame({"v": SCHEMA_VERSION, "t": type_name, "d": {}})
    header_end = 4 + int.from_bytes(whole[:4], "big")
    cut = data.draw(st.integers(0, header_end - 1))
    try:
        decode(whole[:cut], cls)
    except BadMessage:
        return
    raise AssertionError(f"{type_name} cut at {cut} of {header_end} header bytes was accepted")


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=5), max_size=4), st.lists(st.integers(-5, 50), max_size=4), st.binary(max_size=60))
def test_a_stream_batch_that_lies_about_its_frames_is_a_bad_message(streams, sizes, blob):
    from llmesh.wire.messages import StreamBatch

    try:
        parts = split_batch(encode(StreamBatch(streams=streams, sizes=sizes), blob))
    except BadMessage:
        return
    assert [len(p) for _, p in parts] == sizes and sum(sizes) == len(blob)
