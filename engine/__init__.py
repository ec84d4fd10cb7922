"""Request lifecycle: front ends (LLM, AsyncLLM), engine core, executor, workers, runner, sampler."""

from common.sampling_params import SamplingParams
from engine.async_llm import AsyncLLM
from engine.llm import LLM

__all__ = ["LLM", "AsyncLLM", "SamplingParams"]
