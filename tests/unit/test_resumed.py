"""A request resumed on another engine samples on from where one engine's random stream stands."""

import torch


def _sampled(sampler, logits: torch.Tensor, generator: torch.Generator, steps: int) -> list[int]:
    """`steps` tokens sampled by vLLM's CPU sampler from one request's row, its generator `generator`."""
    return [int(sampler.forward_cpu(logits.clone(), {0: generator}, None, None)[0][0]) for _ in range(steps)]


def test_a_generator_past_the_earlier_draws_samples_as_the_one_engines_does():
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from llmesh.engine.resumed import skip_draws

    current_platform.import_kernels()  # the sampler's fused op, as an engine loads it
    sampler = TopKTopPSampler()
    logits = torch.randn((1, 64), generator=torch.Generator().manual_seed(0))
    for earlier in (1, 5, 40):
        one_engine = _sampled(sampler, logits, torch.Generator().manual_seed(7), earlier + 12)
        resumed = torch.Generator().manual_seed(7)
        skip_draws(resumed, earlier)
        assert _sampled(sampler, logits, resumed, 12) == one_engine[earlier:]
        assert _sampled(sampler, logits, torch.Generator().manual_seed(7), 12) != one_engine[earlier:]  # it matters


def test_vllms_request_state_made_for_a_resumed_seeded_request_starts_past_its_earlier_output():
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    from llmesh.engine.resumed import continue_seeded_streams, earlier_output_args, skip_draws

    continue_seeded_streams()
    continue_seeded_streams()  # once only, however often the plugin loads

    def state(generator: torch.Generator, earlier: int) -> CachedRequestState:
        params = SamplingParams(temperature=1.0, seed=3, extra_args=earlier_output_args(earlier))
        return CachedRequestState("r", list(range(10)), [], params, generator, ([],), 0, [])

    made = state(torch.Generator().manual_seed(3), 4).generator
    expected = torch.Generator().manual_seed(3)
    skip_draws(expected, 4)
    assert torch.equal(made.get_state(), expected.get_state())
    fresh = state(torch.Generator().manual_seed(3), 0).generator  # nothing earlier: the seed's start
    assert torch.equal(fresh.get_state(), torch.Generator().manual_seed(3).get_state())


def test_on_cuda_skipping_draws_equals_drawing_vllms_noise():
    """vLLM's CUDA sampler draws an exponential per vocabulary entry a step (`random_sample`); on a GPU
    host (skipped here) the skip must land where those draws do, for vocabularies of every size."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from llmesh.engine.resumed import skip_draws

    for vocab in (2000, 32000, 128256, 152064):
        drawn, skipped = (torch.Generator(device="cuda").manual_seed(5) for _ in range(2))
        noise = torch.empty(vocab, dtype=torch.float32, device="cuda")
        for _ in range(7):
            noise.exponential_(generator=drawn)
        skip_draws(skipped, 7)
        assert torch.equal(noise.exponential_(generator=drawn), torch.empty_like(noise).exponential_(generator=skipped))


def test_a_resumed_grammar_reads_the_earlier_output_past_its_reasoning_alone():
    """`resume_grammar` feeds the grammar the earlier output's tokens it read on the engine before: all of
    them, or the last `constrained` (llmesh.engine.reasoning: those past the reasoning's end)."""
    from types import SimpleNamespace

    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    from llmesh.engine.resumed import earlier_output_args, resume_grammar

    class Recorded(StructuredOutputGrammar):  # (a test double of a compiled grammar: what it was fed)
        def __init__(self):
            self.fed: list[int] = []

        def accept_tokens(self, request_id, tokens):
            self.fed += tokens
            return True

        validate_tokens = rollback = fill_bitmask = is_terminated = reset = None

    prompt, earlier = [1, 2, 3], [10, 11, 12, 13]
    for constrained, fed in ((None, earlier), (4, earlier), (1, [13]), (0, [])):
        grammar = Recorded()
        request = SimpleNamespace(
            request_id="r",
            prompt_token_ids=prompt + earlier,
            structured_output_request=SimpleNamespace(grammar=grammar),
            sampling_params=SimpleNamespace(extra_args=earlier_output_args(len(earlier), constrained)),
        )
        resume_grammar(request)
        assert grammar.fed == fed, constrained
