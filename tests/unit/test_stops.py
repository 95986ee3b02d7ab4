import pytest

from llmesh_router.stops import StopFilter


def run(stops, deltas, include=False):
    f, out = StopFilter(stops, include), []
    for d in deltas:
        text, stop = f.feed(d)
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    return "".join(out) + f.flush(), None


@pytest.mark.parametrize(
    "stops, deltas, expected",
    [
        ([], ["ab", "cd"], ("abcd", None)),
        (["XY"], ["abX", "Ycd"], ("ab", "XY")),  # spans the boundary
        (["XY"], ["ab", "cXYd"], ("abc", "XY")),
        (["XY"], ["abX", "Zcd"], ("abXZcd", None)),  # a false start is released
        (["long stop", "s"], ["long st", "op"], ("long ", "s")),  # the stop that ends first wins
        (["Y", "XY", "X"], ["aXY"], ("a", "X")),  # of several at once, the one that ends first
        (["abcdef", "cd"], ["xabcdefy"], ("xab", "cd")),  # (not the one that starts first)
        (["Y", "XY"], ["aXY"], ("aX", "Y")),  # of two that end together, the first listed
        (["XY"], ["X"], ("X", None)),  # held back, released at the end
    ],
)
def test_stop_filter(stops, deltas, expected):
    assert run(stops, deltas) == expected


def test_nothing_that_may_start_a_stop_is_released_early():
    f = StopFilter(["END"])
    assert f.feed("abcE") == ("ab", None)
    assert f.feed("N") == ("c", None)
    assert f.feed("D!") == ("", "END")


@pytest.mark.parametrize(
    "stops, deltas, expected",
    [
        (["XY"], ["abX", "Ycd"], ("abXY", "XY")),  # spans the boundary: kept, the rest cut
        (["XY"], ["ab", "cXYd"], ("abcXY", "XY")),
        (["XY"], ["abX", "Zcd"], ("abXZcd", None)),
        (["long stop", "s"], ["long st", "op"], ("long s", "s")),
    ],
)
def test_stop_filter_keeping_the_stop_string(stops, deltas, expected):
    assert run(stops, deltas, include=True) == expected


def test_kept_stop_strings_hold_nothing_back():
    f = StopFilter(["END"], include=True)
    assert f.feed("abcE") == ("abcE", None)
    assert f.feed("N") == ("N", None)
    assert f.feed("D!") == ("D", "END")


@pytest.mark.parametrize("include", [False, True])
def test_the_output_and_stop_are_vllms_detokenizers_for_any_deltas(include):
    """Against vLLM's own stop check, run as its detokenizer runs it on each step's new text."""
    import random

    from vllm.v1.engine.detokenizer import check_stop_strings

    rng = random.Random(5)
    for _ in range(3000):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        deltas = ["".join(rng.choices("abcd", k=rng.randint(0, 4))) for _ in range(rng.randint(1, 8))]
        text, stop = "", None
        for delta in deltas:
            text += delta
            if (hit := check_stop_strings(text, len(delta), stops, include)) is not None:
                stop, truncate_to = hit
                text = text if truncate_to == -1 else text[:truncate_to]
                break
        assert run(stops, deltas, include) == (text, stop), (stops, deltas)


# ---- vLLM's repetition_detection over the whole output, across engines ---------------------------------------


def test_repetition_is_found_as_vllms_engine_finds_it():
    import random

    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched.utils import check_sequence_repetition

    from llmesh.wire.messages import RepetitionDetection

    rng = random.Random(7)
    for _ in range(3000):
        fields = {"max_pattern_size": rng.randint(0, 5), "min_count": rng.randint(2, 4)}
        fields["min_pattern_size"] = rng.randint(0, fields["max_pattern_size"])
        ids = [rng.randint(0, 2) for _ in range(rng.randint(0, 24))]
        expected = check_sequence_repetition(ids, RepetitionDetectionParams(**fields))
        assert RepetitionDetection(**fields).ends(ids) == expected, (fields, ids)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <= max_pattern_size"),
        ({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
        ({"max_pattern_size": -1}, "greater than or equal to 0"),
    ],
)
def test_repetition_detection_is_checked_as_vllm_checks_it(fields, words):
    from pydantic import ValidationError

    from llmesh_router.schemas import CompletionRequest

    with pytest.raises(ValidationError, match=words):
        CompletionRequest(model="m", prompt="x", repetition_detection=fields)
    assert CompletionRequest(model="m", prompt="x", repetition_detection={"max_pattern_size": 0}).sampling()


def _delta(ids, done, text=None, finish=None):
    from llmesh.wire.messages import TokenDelta

    return TokenDelta(
        text=text if text is not None else "".join(f"<{t}>" for t in ids),
        token_ids=ids,
        completion_tokens=done + len(ids),
        finish_reason=finish,
        logprobs=[[(t, -1.0, f"<{t}>")] for t in ids],
    )


def test_a_repetition_across_engines_ends_the_output_at_the_token_that_completes_it():
    """The prefill's first token and a decode engine's (or a migration target's) tokens make the repetition
    together: neither engine sees it, the router ends the output where one engine would have."""
    from llmesh.wire.messages import SamplingOptions
    from llmesh_router.stops import REPEATED, OutputEnd

    detect = {"max_pattern_size": 2, "min_count": 3}
    ends = OutputEnd(SamplingOptions(repetition_detection=detect))
    shown = [ends.shown(_delta([5], 0)), ends.shown(_delta([7, 5], 1))]  # 5, 7, 5
    assert [d.finish_reason for d in shown] == [None, None]
    cut = ends.shown(_delta([7, 5, 7, 9], 3))  # 5 7 5 7 5 7: the pair repeated 3 times at its 6th token
    assert (cut.token_ids, cut.completion_tokens, cut.finish_reason, cut.stop_reason) == (
        [7, 5, 7],
        6,
        "repetition",
        REPEATED,
    )
    assert [step[0][0] for step in cut.logprobs] == [7, 5, 7]

    late = OutputEnd(SamplingOptions(repetition_detection={"max_pattern_size": 1, "min_count": 2}, min_tokens=4))
    assert [late.shown(_delta([3], i)).finish_reason for i in range(4)] == [None, None, None, "repetition"]


def test_an_engines_own_end_or_a_stop_string_wins_over_a_repetition_as_in_vllm():
    from llmesh.wire.messages import SamplingOptions
    from llmesh_router.stops import OutputEnd

    detect = {"max_pattern_size": 1, "min_count": 2}
    ends = OutputEnd(SamplingOptions(repetition_detection=detect))
    ends.shown(_delta([4], 0))
    assert ends.shown(_delta([4], 1, finish="length")).finish_reason == "length"  # (vLLM checks the length first)

    ends = OutputEnd(SamplingOptions(repetition_detection=detect, stop=["ab"]))
    assert ends.shown(_delta([4], 0, text="xa")).text == "x"  # ("a" may begin the stop string: held)
    stopped = ends.shown(_delta([4], 1, text="by"))
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == ("", "stop", "ab")

    ends = OutputEnd(SamplingOptions(repetition_detection=detect, stop=["ab"]))
    ends.shown(_delta([4], 0, text="xa"))
    repeated = ends.shown(_delta([4], 1, text="c"))
    assert (repeated.text, repeated.finish_reason) == ("ac", "repetition")  # the held text released at the end


def _joined(ids, done, finish=None):
    """A decode worker's delta of several engine steps vLLM joined (its reader was slow): each token's text
    end given."""
    delta = _delta(ids, done, finish=finish)
    return delta.model_copy(update={"text_ends": [sum(len(f"<{t}>") for t in ids[: i + 1]) for i in range(len(ids))]})


def test_an_output_ends_inside_a_delta_of_joined_steps_at_the_token_an_engine_ends_it():
    """vLLM ends an output at a token, each step checked; a decode worker's delta may join several steps, the
    engine's own end on its last: a repetition or a stop string the router finds inside it cuts its tokens,
    text and logprobs there (the failure in CI: a repetition completed by its second token was passed by)."""
    from llmesh.wire.messages import SamplingOptions
    from llmesh_router.stops import REPEATED, OutputEnd

    ends = OutputEnd(SamplingOptions(repetition_detection={"max_pattern_size": 4, "min_count": 3}))
    ends.shown(_delta([1000], 0))  # the prefill's token
    cut = ends.shown(_joined([1000, 1000, 1000], 1, finish="repetition"))  # decode's engine saw only its own
    assert (cut.token_ids, cut.text, cut.completion_tokens, cut.finish_reason, cut.stop_reason) == (
        [1000, 1000],
        "<1000><1000>",
        3,
        "repetition",
        REPEATED,
    )
    assert len(cut.logprobs) == 2 and cut.text_ends is None

    ends = OutputEnd(SamplingOptions(stop=["<3><4"]))
    ends.shown(_delta([2], 0))
    stopped = ends.shown(_joined([3, 4, 5, 6], 1))
    assert (stopped.token_ids, stopped.text, stopped.completion_tokens, stopped.stop_reason) == (
        [3, 4],
        "<2>",
        3,
        "<3><4",
    )
    # without the ends, a delta ends as a whole
    whole = OutputEnd(SamplingOptions(stop=["<3><4"])).shown(_delta([3, 4, 5], 0))
    assert (whole.token_ids, whole.text, whole.finish_reason) == ([3, 4, 5], "", "stop")
