"""bench/call_path.py's reading walk and its counts, on synthetic call edges (no mesh started)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_call_path", ROOT / "bench" / "call_path.py")
assert spec and spec.loader
call_path = importlib.util.module_from_spec(spec)
spec.loader.exec_module(call_path)

HANDLER, PICK, VIEW, RELEASE = ("a.py", "handler"), ("b.py", "pick"), ("a.py", "view"), ("b.py", "release")


def test_the_walk_goes_depth_first_along_each_edge_once_and_back_to_the_caller():
    edges = [(HANDLER, PICK), (PICK, VIEW), (VIEW, VIEW), (PICK, VIEW), (HANDLER, RELEASE), (HANDLER, PICK)]
    assert call_path.reading_walk(HANDLER, edges) == [HANDLER, PICK, VIEW, PICK, HANDLER, RELEASE, HANDLER]
    assert call_path.reading_walk(HANDLER, edges, returns=False) == [HANDLER, PICK, VIEW, RELEASE]


def test_a_function_reached_again_by_another_caller_is_entered_but_its_calls_are_not_walked_again():
    shared, leaf = ("c.py", "shared"), ("d.py", "leaf")
    edges = [(HANDLER, shared), (shared, leaf), (HANDLER, PICK), (PICK, shared)]
    walk = call_path.reading_walk(HANDLER, edges)
    assert walk == [HANDLER, shared, leaf, shared, HANDLER, PICK, shared, PICK, HANDLER]


def test_counts_of_stays_files_entries_functions_and_returns():
    walk = [HANDLER, PICK, VIEW, PICK, HANDLER, ("a.py", "finish"), RELEASE, HANDLER]
    counts = call_path.path_counts(walk)
    assert [stay["file"] for stay in counts["path"]] == ["a.py", "b.py", "a.py", "b.py", "a.py", "b.py", "a.py"]
    assert counts["path"][4]["functions"] == ["handler", "finish"]
    assert (counts["stays"], counts["files"], counts["returns"]) == (7, 2, 5)
    assert counts["per_file"] == {"a.py": {"entered": 4, "functions": 3}, "b.py": {"entered": 3, "functions": 2}}


def test_a_root_that_calls_nothing_is_one_stay():
    counts = call_path.path_counts(call_path.reading_walk(HANDLER, []))
    assert (counts["stays"], counts["files"], counts["returns"]) == (1, 1, 0)
