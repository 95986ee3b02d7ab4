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
