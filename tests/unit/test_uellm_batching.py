"""UELLM's batch formation (llmesh.policies.uellm), by hand against the authors' code's rules, and its
experiment (llmesh_sim.uellm)."""

import pytest

from llmesh.policies.uellm import BatchItem, s3_batches, slo_odbs_batches


def test_slo_odbs_orders_by_weighted_target_and_output_and_cuts_a_batch_at_its_padding_limit():
    # keys (1 s + 1.2 a token): 160, 112, 1400, 114
    items = [BatchItem(100, 50), BatchItem(100, 10), BatchItem(200, 1000), BatchItem(90, 20)]
    # padding of item 2: (1000 - 50) longer than the batch's longest, x 4 with it, x 1.2 = 4560 > 3750
    assert slo_odbs_batches(items) == [[1, 3, 0], [2]]
    # a full batch opens the next; there item 2 adds (1000 - 50) x 2 x 1.2 = 2280: it joins
    assert slo_odbs_batches(items, max_batch=2) == [[1, 3], [0, 2]]


def test_slo_odbs_takes_a_shorter_output_into_a_batch_at_no_padding_and_without_predictions_goes_by_target():
    longer_first = [BatchItem(10, 400), BatchItem(480, 20)]  # keys 490 and 504
    assert slo_odbs_batches(longer_first) == [[0, 1]]
    unpredicted = [BatchItem(slo, None) for slo in (30, 10, 20)] * 4
    assert slo_odbs_batches(unpredicted) == [[1, 4, 7, 10, 2, 5, 8, 11, 0, 3], [6, 9]]


def test_s3_fills_batches_shortest_first_up_to_its_output_limit():
    items = [BatchItem(0, 100), BatchItem(0, 100), BatchItem(0, 60), BatchItem(0, 200)]
    assert s3_batches(items) == [[2, 0], [1], [3]]  # 60 + 100 + 100 > 256
    assert s3_batches(items, output_limit=1000, max_batch=3) == [[2, 0, 1], [3]]


def test_a_static_batch_runs_its_padded_prompts_then_a_step_per_token_of_its_longest_output():
    from llmesh_sim.engine import SimRequest
    from llmesh_sim.uellm import run_static, static_batch_s

    from .test_sim import PROFILE  # 10 ms a step, 1 ms a prompt token, 2 ms a request decoding

    a, b, c = SimRequest("a", 0.0, 100, 3), SimRequest("b", 0.0, 50, 1), SimRequest("c", 0.0, 10, 2)
    assert static_batch_s(PROFILE, [a, b]) == pytest.approx(0.21 + 2 * 0.014)  # 2 x 100 padded tokens
    assert run_static([a, b, c], PROFILE, [[2], [0, 1]]) == pytest.approx([0.238 + 0.032, 0.238 + 0.032, 0.032])


def test_the_uellm_experiment_runs_each_system_and_prediction(tmp_path):
    from llmesh_sim.uellm import main

    out = tmp_path / "uellm.md"
    assert main(["--requests", "30", "--seeds", "0", "--slo-scales", "0.04", "--out", str(out)]) == 0
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()]
    rows = [r[1:3] for r in rows if r[0] == "0.04"]
    assert rows == [
        ["S3", "oracle"],
        ["SLO-ODBS", "oracle"],
        ["batches of 10", "-"],
        ["vLLM", "-"],
        ["S3", "real"],
        ["SLO-ODBS", "real"],
        ["S3", "none"],
        ["SLO-ODBS", "none"],
    ]
