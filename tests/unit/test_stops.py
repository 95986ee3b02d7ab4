import pytest

from llmesh_router.stops import StopFilter


def run(stops, deltas):
    f, out = StopFilter(stops), []
    for d in deltas:
        text, hit = f.feed(d)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + f.flush(), False


@pytest.mark.parametrize(
    "stops, deltas, expected",
    [
        ([], ["ab", "cd"], ("abcd", False)),
        (["XY"], ["abX", "Ycd"], ("ab", True)),  # spans the boundary
        (["XY"], ["ab", "cXYd"], ("abc", True)),
        (["XY"], ["abX", "Zcd"], ("abXZcd", False)),  # a false start is released
        (["long stop", "s"], ["long st", "op"], ("long ", True)),  # the earliest stop wins
        (["XY"], ["X"], ("X", False)),  # held back, released at the end
    ],
)
def test_stop_filter(stops, deltas, expected):
    assert run(stops, deltas) == expected


def test_nothing_that_may_start_a_stop_is_released_early():
    f = StopFilter(["END"])
    assert f.feed("abcE") == ("ab", False)
    assert f.feed("N") == ("c", False)
    assert f.feed("D!") == ("", True)
