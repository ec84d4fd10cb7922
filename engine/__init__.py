"""Request lifecycle: front ends (LLM, AsyncLLM), engine core, executor, workers, runner, sampler."""

from engine.sampling_params import SamplingParams


def __getattr__(name):
    # Imported lazily so that `engine.distributed` and friends load without the whole engine.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(name)


__all__ = ["LLM", "AsyncLLM", "SamplingParams"]
