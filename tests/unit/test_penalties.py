"""llmesh.engine.penalties against vLLM's own penalties: the same logits bit for bit, the output split
between an earlier engine (the end of this one's prompt) and this one at every point."""

import pytest
import torch


def _monolithic(logits, prompt, output, repetition, frequency, presence):
    """What vLLM's sampler does to a request's row that generated `output` after `prompt` on one engine."""
    from vllm.model_executor.layers.utils import apply_penalties

    vocab = logits.shape[1]
    return apply_penalties(
        logits.clone(),
        torch.tensor([prompt]),
        torch.tensor([output or [vocab]]),  # (vLLM pads with the vocabulary's size)
        torch.tensor([presence], dtype=torch.float32),
        torch.tensor([frequency], dtype=torch.float32),
        torch.tensor([repetition], dtype=torch.float32),
    )


@pytest.mark.parametrize("earlier", [0, 1, 5, 12])
@pytest.mark.parametrize("repetition, frequency, presence", [(1.0, 0.7, 0.0), (1.0, 0.0, -1.3), (1.3, 0.3, 0.1)])
def test_penalties_over_the_whole_output_equal_one_engines_bit_for_bit(earlier, repetition, frequency, presence):
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from llmesh.engine.penalties import OutputPenalties, output_penalties
    from llmesh.engine.resumed import earlier_output_args

    generator = torch.Generator().manual_seed(earlier)
    vocab = 64
    prompt = torch.randint(0, vocab, (20,), generator=generator).tolist()
    output = torch.randint(0, vocab // 4, (12,), generator=generator).tolist()  # repeats, so counts > 1
    logits = torch.randn((3, vocab), generator=generator).to(torch.bfloat16).to(torch.float32)  # ties, as bf16 gives

    config = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: vocab))
    processor = OutputPenalties(config, torch.device("cpu"), False)  # type: ignore[arg-type]
    params = SamplingParams(extra_args=output_penalties(repetition, frequency, presence) | earlier_output_args(earlier))
    own = output[earlier:]  # this engine's output so far: vLLM's list
    processor.update_state(BatchUpdate(3, [], [(1, params, prompt + output[:earlier], own)], []))
    got = processor.apply(logits.clone())

    expected = _monolithic(logits[1:2], prompt, output, repetition, frequency, presence)
    assert torch.equal(got[1:2], expected)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])  # other rows untouched
    own.append(output[0])  # the engine's next step: its list grew
    assert torch.equal(
        processor.apply(logits.clone())[1:2],
        _monolithic(logits[1:2], prompt, [*output, output[0]], repetition, frequency, presence),
    )


def test_a_request_without_output_penalties_is_left_to_vllm():
    from vllm import SamplingParams

    from llmesh.engine.worker import sampling_params
    from llmesh.wire.messages import SamplingOptions

    plain = sampling_params(SamplingOptions(repetition_penalty=1.2), max_tokens=4, kv_transfer_params={})
    assert plain.repetition_penalty == 1.2 and "output_penalties" not in plain.extra_args
    both = sampling_params(
        SamplingOptions(repetition_penalty=1.2, frequency_penalty=0.5), max_tokens=4, kv_transfer_params={}, generated=3
    )
    assert isinstance(both, SamplingParams) and both.repetition_penalty == 1.0 and both.frequency_penalty == 0.0
    assert both.extra_args["output_penalties"] == {"repetition": 1.2, "frequency": 0.5, "presence": 0.0}
    assert both.extra_args["earlier_output"] == 3
