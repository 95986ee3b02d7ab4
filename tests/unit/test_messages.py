import pytest

from llmesh.wire.errors import BadMessage, ContextLengthExceeded
from llmesh.wire.messages import (
    ErrorReply,
    KvShardInfo,
    LengthPredictRequest,
    PrefillRequest,
    TokenDelta,
    decode,
    decode_any,
    encode,
)


def test_round_trip_with_blob():
    msg = KvShardInfo(shard="0", data_host="127.0.0.1", data_port=1234, heartbeat_s=1.5)
    got, blob = decode(encode(msg, b"abcde"), KvShardInfo)
    assert got == msg and bytes(blob) == b"abcde"


def test_error_reply_is_raised_typed():
    with pytest.raises(ContextLengthExceeded, match="too long"):
        decode_any(encode(ErrorReply(code="context_length_exceeded", message="too long", param="prompt")))


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"", "shorter than its header"),
        (b"\x00\x00\x00\x10abc", "claims 16 bytes"),
        (b"\x00\x00\x00\x03\xc1\xc1\xc1", "undecodable"),
        (encode(TokenDelta(text="x", token_ids=[1])).replace(b"TokenDelta", b"NoSuchType"), "unknown message type"),
    ],
)
def test_bad_frames_are_rejected_clearly(frame, match):
    with pytest.raises(BadMessage, match=match):
        decode_any(frame)


def test_wrong_type_and_invalid_fields():
    with pytest.raises(BadMessage, match="expected KvShardInfo"):
        decode(encode(TokenDelta(text="", token_ids=[])), KvShardInfo)
    import msgpack

    header = msgpack.packb(
        {"v": 1, "t": "PrefillRequest", "d": {"request_id": "r", "model": "m", "max_tokens": 0, "deadline": 0}}
    )
    with pytest.raises(BadMessage, match="invalid PrefillRequest"):
        decode(len(header).to_bytes(4, "big") + header, PrefillRequest)


def test_other_schema_versions_are_refused():
    import msgpack

    header = msgpack.packb({"v": 99, "t": "Ack", "d": {}})
    with pytest.raises(BadMessage, match="schema version 99"):
        decode_any(len(header).to_bytes(4, "big") + header)


def test_text_that_is_not_unicode_cannot_be_sent():
    with pytest.raises(BadMessage, match="not valid Unicode"):
        encode(LengthPredictRequest(prompt="lone \ud800 surrogate"))


def test_unknown_fields_are_ignored_so_a_newer_sender_does_not_break_an_older_receiver():
    import msgpack

    frame = encode(TokenDelta(text="x", token_ids=[1]))
    n = int.from_bytes(frame[:4], "big")
    head = msgpack.unpackb(frame[4 : 4 + n])
    head["d"]["field_from_the_future"] = {"any": [1, 2]}
    header = msgpack.packb(head)
    msg, _ = decode_any(len(header).to_bytes(4, "big") + header)
    assert msg == TokenDelta(text="x", token_ids=[1])
