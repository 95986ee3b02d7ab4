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
        (["long stop", "s"], ["long st", "op"], ("long ", "s")),  # the earliest stop wins
        (["Y", "XY", "X"], ["aXY"], ("a", "XY")),  # of two at once, the first listed
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
